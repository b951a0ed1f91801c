"""``flashcore serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn, SSE streaming) over one
:class:`~flashcore.engine.Engine`.

:mod:`~flashcore.serve.cli` is the command line, :mod:`~flashcore.serve.app` the routes and the bridge from the
engine's thread into asyncio, :mod:`~flashcore.serve.protocol` the wire schema, and :mod:`~flashcore.serve.access`
the API key and body-size guards. Needs flashcore's ``[serve]`` extra (and ``[hf]``, as the engine does).
"""
