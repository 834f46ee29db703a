"""pipeserve's Kubernetes operator (kopf): InferencePipeline resources → per-group StatefulSets and
headless Services, group restarts through the shared decision (`pipeserve.care.restarts`), status.

Modules: crd (the CRD, defaults), resources (pure builders), kube (API calls), observe (pods →
observation), groups (acting on a decision), handlers (kopf), leader (Lease election), main (CLI).
"""
