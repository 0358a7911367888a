"""The CPU demo model behind real gunicorn + gevent, recording the order in which sequences are admitted.

A prompt that contains ``client N`` is tagged N, so a test can line up each client's request with the order the
scheduler admitted it; ``/stats`` lists ``engine.admissions`` as ``[sequence id, tag]`` pairs. Sequence ids are
given in order of arrival, so first come first served means the ids come out sorted.
Run: ``python -m tests.server.recording_server [setting flags]``.
"""

from __future__ import annotations

import logging
import re
import sys

from glm53 import config
from glm53.engine.tiny.backend import TinyBackend
from glm53.server.gunicorn_app import serve


class RecordingTinyBackend(TinyBackend):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.admissions: list[list] = []

    def add(self, seq_id, prompt_ids, sampling, logprobs=None, constraint=None):
        super().add(seq_id, prompt_ids, sampling, logprobs, constraint)
        tag = re.search(r"client (\d+)", self.tokenizer.decode(prompt_ids))
        self.admissions.append([seq_id, int(tag.group(1)) if tag else None])

    def stats(self) -> dict:
        return {**super().stats(), "admissions": self.admissions}


def main() -> None:
    settings = config.load(sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(settings, backend_factory=lambda: RecordingTinyBackend(
        context_length=settings.cache_size, max_batch_size=settings.max_batch_size, chunk_size=settings.chunk_size))


if __name__ == "__main__":
    main()
