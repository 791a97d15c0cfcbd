"""The floor: what serving /classify costs on this core before any request work, a row beside the service and its
peers in `service_bench` (issue #20).

A bare HTTP/1.1 keep-alive server on uvloop's asyncio protocol. Per request it parses no JSON, validates nothing,
tokenises nothing (a body's token ids are looked up: each distinct body is tokenised once), keeps no metrics, ids,
deadlines or logs, and answers a fixed JSON per label; the requests read in one turn of the event loop run as one
batch of at most `--max-batch` (`service_bench` passes the model alone's best batch size at the run's length) in
`session.run` on the event loop itself (no thread to hop to), one batch per turn. The model is the bundle's, with
the service's session settings (`ClassifierRuntime`, one ORT thread). So its figures are what serving costs on a core
before any request work: a goal it meets is within reach there, and one it misses is out of reach of a server this
simple (not a strict bound for every design: at 512 tokens the service, whose model runs on a thread of its own
beside a SCHED_BATCH event loop, once served more than it; benchmarks/results/service-bench-session31/).

    python benchmarks/peers/floor_classify.py --bundle models/classify-linformer --port 8000 [--max-batch 32]
    curl localhost:8000/classify -d '{"text": "A wonderful film."}'   # {"label": "positive"}

GET /metrics answers the batches it ran (`floor_batch_size_sum`, `floor_batch_size_count`); any other GET, 200.
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

import uvloop

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from service.batcher import pad  # noqa: E402
from service.bundle import load_bundle  # noqa: E402
from service.runtime import CPU, ClassifierRuntime, make_session  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402


def answer(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status.encode(), content_type, len(body), body))  # fmt: skip


class Floor:
    def __init__(self, bundle_dir: Path, max_batch: int):
        bundle = load_bundle(bundle_dir)
        self.tokenizer = Tokenizer.from_bundle(bundle)
        session = make_session(bundle.onnx_path("model"), [CPU], intra_op_threads=1, inter_op_threads=1,
                               cpu_mem_arena=True)  # fmt: skip
        self.runtime = ClassifierRuntime(session)
        self.pad_id, self.max_batch = bundle.pad_id, max_batch
        self.answers = [answer("200 OK", json.dumps({"label": label}).encode()) for label in bundle.labels]
        self.ids: dict[bytes, list[int]] = {}
        self.pending: list[tuple[asyncio.Transport, list[int]]] = []
        self.scheduled = False
        self.texts = self.batches = 0

    def submit(self, transport: asyncio.Transport, body: bytes) -> None:
        ids = self.ids.get(body)
        if ids is None:
            text = json.loads(body)["text"]
            ids = self.ids[body] = self.tokenizer.encode_to_classify([text], truncate=True)[0].ids
        self.pending.append((transport, ids))
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.run_batch)

    def run_batch(self) -> None:
        """One batch of what is pending, then the next turn of the loop (which reads what arrived meanwhile)."""
        batch, self.pending = self.pending[: self.max_batch], self.pending[self.max_batch :]
        input_ids, mask = pad([ids for _, ids in batch], self.pad_id)
        best = self.runtime.run(input_ids, mask).argmax(axis=1)
        for (transport, _), label in zip(batch, best.tolist(), strict=True):
            if not transport.is_closing():
                transport.write(self.answers[label])
        self.texts += len(batch)
        self.batches += 1
        self.scheduled = bool(self.pending)
        if self.scheduled:
            asyncio.get_running_loop().call_soon(self.run_batch)

    def metrics(self) -> bytes:
        text = f"floor_batch_size_sum {self.texts}\nfloor_batch_size_count {self.batches}\n".encode()
        return answer("200 OK", text, b"text/plain")


class Connection(asyncio.Protocol):
    """Requests with a Content-Length body (or none), in order, keep-alive; nothing else of HTTP."""

    def __init__(self, floor: Floor):
        self.floor = floor
        self.buffer = b""

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            request_line, *headers = self.buffer[:end].split(b"\r\n")
            length = next((int(value) for name, _, value in (h.partition(b":") for h in headers)
                           if name.strip().lower() == b"content-length"), 0)  # fmt: skip
            if len(self.buffer) < end + 4 + length:
                return
            body, self.buffer = self.buffer[end + 4 : end + 4 + length], self.buffer[end + 4 + length :]
            method, path = request_line.split(b" ")[:2]
            if method == b"POST":
                self.floor.submit(self.transport, body)
            elif path == b"/metrics":
                self.transport.write(self.floor.metrics())
            else:
                self.transport.write(answer("200 OK", b"ok", b"text/plain"))


async def serve(floor: Floor, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: Connection(floor), "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=REPO / "models" / "classify-linformer")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=32)
    args = parser.parse_args()
    uvloop.run(serve(Floor(args.bundle, args.max_batch), args.port))


if __name__ == "__main__":
    main()
