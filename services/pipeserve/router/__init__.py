"""The router: OpenAI's HTTP API in front of the pipeline groups' stage 0.

A request's way, one direction through the layers (tests/test_import_graph.py keeps it so):
errors (shared) <- features/ <- api/ <- upstream/ <- http/ ; a package imports only those left of it.
"""
