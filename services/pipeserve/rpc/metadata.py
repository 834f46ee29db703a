"""gRPC metadata keys shared by the router and stage 0 (no imports: the router stays free of the engine)."""

# Initial metadata stage 0 sends on a Generate call once the request is admitted. A call that
# fails UNAVAILABLE after it saw its group die with the request inside (DESIGN §2.5).
ADMITTED_KEY = "pipeserve-admitted"
