"""The peer users would deploy instead of us: CTranslate2 behind a small FastAPI wrapper (benchmark only).

This is how CTranslate2 is usually put behind HTTP: a synchronous endpoint (FastAPI runs it in its thread pool)
that tokenises, calls `Translator.translate_batch` on the request's texts, and detokenises. There is no batching
across requests: concurrent calls wait in CTranslate2's own queue for one of its `inter_threads` workers. The
request and response JSON are the service's (service/schemas.py), so one Locust file (loadtest/translate.py)
or one load generator drives both; GET /v1/models and /readyz answer as the service's do, as far as the load
tools read them.

    .venv/bin/python -m benchmarks.ctranslate2_server --bundle models/translate-transformer [--compute-type int8] \
        [--threads 1] [--port 8100]

The bundle is converted by export/ctranslate2.py into .cache/ct2/<bundle name>-<manifest sha256, 12 digits> on
first start (seconds; a retrained bundle of the same name is converted again), and
its tokenizer and n_max are the service's, so both sides see the same token ids.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fastapi import FastAPI, HTTPException  # noqa: E402

from service.bundle import Bundle, load_bundle, sha256_of  # noqa: E402
from service.schemas import TranslateRequest, TranslateResponse  # noqa: E402
from service.tokenizer import TextTooLong, Tokenizer  # noqa: E402

CONVERTED = REPO / ".cache" / "ct2"


class CTranslate2Runtime:
    """A CTranslate2 Translator over a bundle's token ids: what the peer server and the decode benchmark call.

    `run(input_ids, attention_mask, (beam_size, max_new_tokens))` has TranslatorRuntime's contract (padded ids
    with EOS in, one list of target ids per row out, no BOS/EOS), so benchmarks can time both the same way."""

    def __init__(self, bundle: Bundle, compute_type: str = "float32", threads: int = 1, model_dir: Path | None = None):
        import ctranslate2

        from export.ctranslate2 import convert, vocabulary

        # converted once per bundle version: a retrained bundle of the same name gets a conversion of its own
        version = sha256_of(bundle.path / "manifest.json")[:12]
        model_dir = model_dir or CONVERTED / f"{bundle.name}-{version}"
        if not (model_dir / "model.bin").exists():
            convert(bundle.path, model_dir)
        self.compute_type, self.threads = compute_type, threads
        # intra_threads: threads per translation, like ORT's intra-op threads; one worker (inter_threads) like
        # our one decoding loop
        self.translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type=compute_type,
                                                 intra_threads=threads, inter_threads=1)  # fmt: skip
        self.pieces = vocabulary(bundle.tokenizer_path)  # id -> piece, as registered in the converted model
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}
        self.eos_id, self.tgt_n_max = bundle.eos_id, bundle.config["tgt_n_max"]

    def translate_ids(self, sources: list[list[int]], beam_size: int = 1, max_new_tokens: int = 256) -> list[list[int]]:
        """Source ids ending in EOS (CTranslate2 adds its own `</s>`: add_source_eos) -> target ids.

        Greedy equals ours token for token; beam search uses CTranslate2's own length normalisation (its
        default), not our GNMT penalty, as its users would run it, so beam outputs may differ."""
        batch = [[self.pieces[i] for i in (ids[:-1] if ids and ids[-1] == self.eos_id else ids)] for ids in sources]
        results = self.translator.translate_batch(
            batch, beam_size=beam_size, max_decoding_length=min(max_new_tokens, self.tgt_n_max),
            max_batch_size=0,  # the caller's batch as it is
        )  # fmt: skip
        return [[self.ids[piece] for piece in result.hypotheses[0]] for result in results]

    def run(self, input_ids, attention_mask, options) -> list[list[int]]:
        beam_size, max_new_tokens = options
        lengths = attention_mask.sum(axis=1)
        sources = [row[:length].tolist() for row, length in zip(input_ids, lengths, strict=True)]
        return self.translate_ids(sources, beam_size, max_new_tokens)


def create_app(bundle: Bundle, runtime: CTranslate2Runtime):
    app = FastAPI(title="CTranslate2 peer (benchmark)")
    tokenizer = Tokenizer.from_bundle(bundle)
    name = f"{bundle.name} (CTranslate2 {runtime.compute_type})"

    @app.post("/translate", response_model=TranslateResponse)
    def translate(body: TranslateRequest) -> TranslateResponse:  # sync: FastAPI runs it in its thread pool
        # each text whole: `split_sentences` is not implemented here (the benchmarks send false to both servers)
        try:
            encoded = tokenizer.encode_all(body.all_texts, truncate=body.truncate)
        except TextTooLong as e:
            raise HTTPException(413, str(e)) from None
        outputs = runtime.translate_ids([e.ids for e in encoded], body.beam_size, body.max_new_tokens)
        return TranslateResponse(model=name, translations=[{"text": tokenizer.decode(ids), "tokens": len(ids)}
                                                           for ids in outputs])  # fmt: skip

    @app.get("/readyz")
    def readyz() -> dict:
        return {"ready": True, "models": [name], "detail": "ok"}

    @app.get("/v1/models")
    def models() -> dict:  # the fields loadtest/translate.py and loadtest/sweep.py read
        model = {"name": name, "task": "translate", "attention": bundle.attention, "n_max": bundle.n_max, "k": None,
                 "labels": [], "execution_provider": "CTranslate2 CPU", "serving": True}  # fmt: skip
        return {"models": [model]}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ctranslate2_server",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--bundle", type=Path, default=REPO / "models" / "translate-transformer")
    parser.add_argument("--compute-type", default="float32", help="CTranslate2 compute_type: float32, int8, ...")
    parser.add_argument("--threads", type=int, default=1, help="intra_threads (ours: LINFORMER_ORT_INTRA_OP_THREADS)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    import uvicorn

    logging.basicConfig(level=args.log_level.upper())
    bundle = load_bundle(args.bundle)
    app = create_app(bundle, CTranslate2Runtime(bundle, args.compute_type, args.threads))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
