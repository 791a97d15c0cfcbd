"""The classify bundle behind Mosec (Rust HTTP front end, Python worker), configured per its docs for the lowest
latency with dynamic batching: one worker, max_batch_size 32, max_wait_time 1 ms (its smallest: 0 means the
10 ms default of `--wait`).

    LINFORMER_BUNDLE=models/classify-linformer python benchmarks/peers/mosec_classify.py --port 8000
    curl -X POST localhost:8000/inference -d '{"text": "A wonderful film."}'
"""

import os

from mosec import Server, Worker


class Classify(Worker):
    def __init__(self):
        super().__init__()
        from classify_model import BundleClassifier  # in the worker process, after the spawn

        self.model = BundleClassifier(os.environ["LINFORMER_BUNDLE"])

    def forward(self, data: list[dict]) -> list[dict]:  # one JSON body per request, a batch of them
        return self.model.classify([request["text"] for request in data])


if __name__ == "__main__":
    server = Server()
    server.append_worker(Classify, num=1, max_batch_size=32, max_wait_time=1)
    server.run()
