"""`mtplx serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one loaded Engine."""
