"""The classify bundle as the peer servers run it: the service's own tokenizer, session settings and softmax, so
that only the serving framework differs. Imports nothing of the service's HTTP stack (no FastAPI)."""

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from service.bundle import load_bundle  # noqa: E402
from service.runtime import CPU, ClassifierRuntime, make_session, probabilities  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402


class BundleClassifier:
    def __init__(self, bundle_dir: str):
        self.bundle = load_bundle(Path(bundle_dir))
        self.tokenizer = Tokenizer.from_bundle(self.bundle)
        # the service's classifier session (service/app.py): ORT's arena on (the service shrinks it only once its
        # compute thread has idled for a second, which a benchmark's steady load never lets it)
        session = make_session(self.bundle.onnx_path("model"), [CPU], intra_op_threads=1, inter_op_threads=1,
                               cpu_mem_arena=True)  # fmt: skip
        self.runtime = ClassifierRuntime(session)

    def classify(self, texts: list[str]) -> list[dict]:
        """Texts -> one result per text, as the service answers them (truncating texts over n_max)."""
        encoded = self.tokenizer.encode_to_classify(texts, truncate=True)
        longest = max(len(e.ids) for e in encoded)
        ids = np.full((len(encoded), longest), self.bundle.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, e in enumerate(encoded):
            ids[row, : len(e.ids)] = e.ids
            mask[row, : len(e.ids)] = 1
        labels = self.bundle.labels
        results = []
        for e, probs in zip(encoded, probabilities(self.runtime.run(ids, mask)), strict=True):
            best = max(range(len(probs)), key=probs.__getitem__)
            scores = dict(zip(labels, probs, strict=True))
            results.append({"label": labels[best], "score": probs[best], "scores": scores, "tokens": len(e.ids),
                            "truncated": e.truncated})  # fmt: skip
        return results
