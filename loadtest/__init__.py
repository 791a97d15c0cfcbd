"""Load tests (Locust), the end-to-end sweep and the model-level Table 3 reproduction: see README.md."""
