"""`python -m service [--host --port --models-dir]` (or `linformer-serve`): run the API under uvicorn."""

import argparse
import logging
import signal
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from service.app import create_app
from service.config import Settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    parser.add_argument("--host", help="overrides LINFORMER_HOST")
    parser.add_argument("--port", type=int, help="overrides LINFORMER_PORT")
    parser.add_argument("--models-dir", type=Path, help="overrides LINFORMER_MODELS_DIR")
    parser.add_argument("--log-level", help="overrides LINFORMER_LOG_LEVEL")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    settings = Settings(**overrides)
    serve(create_app(settings), settings)


def serve(app: FastAPI, settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="time=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    # uvicorn drains on SIGTERM, then re-raises the signal; a completed graceful stop should exit 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            log_config=None,  # keep the key=value format set above
            access_log=False,  # service.access logs each request with its X-Request-ID
            lifespan="on",  # a bundle that fails verification stops the server
            # SIGTERM: stop accepting, let accepted requests finish (bounded by their deadline), exit
            timeout_graceful_shutdown=settings.request_timeout_s + 5,
        )
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
