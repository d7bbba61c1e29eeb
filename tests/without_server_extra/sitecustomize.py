"""Loaded at the start of every Python process that has this folder on PYTHONPATH (tests/test_hardening_http.py):
httptools cannot be imported, as on a machine without the server extra, so `sidecar launch` serves on
asyncio's loop and uvicorn's h11 protocol (sidecar/cli/launch.py, event_loop)."""

import sys

sys.modules["httptools"] = None  # type: ignore[assignment]  # `import httptools` raises ImportError
