"""Process care, the policy side: what keeps a stage process observable and its group restartable.

The side port (/livez, /readyz, /metrics: health), the wedge detector (wedge), and the one group
restart decision (restarts) that `pipeserve up`'s supervisor and the Kubernetes operator share.
Launching processes on this machine is `pipeserve.local`'s, which the operator never imports.
"""
