"""A tiny training corpus on disk (plain-text documents and a chat JSONL) in the tiny
tokenizer's words, for the router-training tests (backoff_core/learning, cli/router)."""

from __future__ import annotations

import json
import random
from pathlib import Path


def write_corpus(root: Path, seed: int = 0, docs: int = 3, chats: int = 4) -> tuple[str, str]:
    """`docs` texts of 90-199 random words under root/texts, `chats` two-turn chats in
    root/chat.jsonl; (texts folder, chat file). The same seed writes the same corpus."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(40)}" for _ in range(n))

    (root / "texts").mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        (root / "texts" / f"d{i}.txt").write_text(words(rng.randrange(90, 200)))
    with (root / "chat.jsonl").open("w") as f:
        for _ in range(chats):
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": words(8)}, {"role": "assistant", "content": words(30)}]}
                )
                + "\n"
            )
    return str(root / "texts"), str(root / "chat.jsonl")
