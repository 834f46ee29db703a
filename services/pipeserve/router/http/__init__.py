"""The HTTP edge: the FastAPI app (app), its guard and shutdown (http_guard), auth/body/admission
(edge), the request handlers that run a request's steps in order (handlers), the server-sent
events (sse_events), several models behind one router (multi) and `pipeserve router` (standalone).
The top layer: it may import every other router package."""
