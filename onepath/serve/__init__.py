"""Serving: the engine behind an OpenAI-compatible HTTP API (`onepath serve`), and the episodes an external
agent runs against it while `onepath train` trains on them. Below train/ (the trainer serves its engine
through it), above engine/ and chat/. Needs the `serve` extra (starlette, uvicorn). docs/serve.md.
"""


def require_extra(what: str) -> None:
    """ValueError saying how to install the serve extra when starlette or uvicorn is missing."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{what} needs the serve extra ({e}): pip install 'onepath[serve]'") from None
