"""Where router data comes from: corpus specs -> token documents.

A spec names one text domain:
- built-in, present on every machine: `stdlib` (code), `docstrings`, `pydoc` (reference
  docs), `notes` (the stdlib's release notes / READMEs / licence), each as `NAME[:SPLIT]`;
  `manpages` (the machine's Unix man pages, sections 1/5/7/8) where /usr/share/man has them;
- `chat-general[:SPLIT]` / `chat-python[:SPLIT]` / `chat-unix[:SPLIT]` (questions about the
  commands of those man pages): the large model's own answers to the templated chat prompts
  of `backoff_core.learning.corpus`, generated once and cached as JSONL;
- a path: a `.jsonl` file of chat records (`{"messages": [...]}`, `{"prompt", "response"}`
  or `{"text"}`), or a text file, or a directory of `.txt/.md/.rst/.py` files.

SPLIT is `train` (the corpus train split minus the calibration bucket), `calib` (that
bucket: 1 document in 10 of the train split, by a hash of its text) or `heldout` (the
corpus held-out split, never used for training anything). For chat records only the
assistant's tokens are router positions: that is what backoff decoding generates.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from backoff_core.learning import corpus, manpages

SPLITS = ("train", "calib", "heldout")
TEXT_DOMAINS = {
    "stdlib": corpus.stdlib_texts,
    "docstrings": corpus.stdlib_docstring_texts,
    "pydoc": corpus.pydoc_topics_texts,
    "notes": corpus.stdlib_notes_texts,
    "manpages": manpages.man_texts,
}
CHAT_DOMAINS = {"chat-general": "general", "chat-python": "python", "chat-unix": "unix"}
CALIB_BUCKETS = 10  # 1 train document in 10 is the calibration set
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")


@dataclass(frozen=True)
class Document:
    """One token sequence; router positions are `start .. len(ids) - 2` (each predicts the next)."""

    ids: tuple[int, ...]
    start: int = 0  # first position whose next token is a router target (chat: the answer)


@dataclass(frozen=True)
class ChatGen:
    """How the large model answers the templated chat prompts (chat-* specs)."""

    samples: int = 64  # prompts answered (a seeded choice among the split's prompts)
    max_tokens: int = 96
    temperature: float = 0.7
    top_p: float = 0.9
    batch_size: int = 8
    seed: int = 0


def parse_spec(spec: str) -> tuple[str, str]:
    """'stdlib:heldout' -> ('stdlib', 'heldout'); a path -> (path, '')."""
    name, _, split = spec.partition(":")
    if name in TEXT_DOMAINS or name in CHAT_DOMAINS:
        split = split or "train"
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r} in corpus spec {spec!r}; choose one of {SPLITS}")
        return name, split
    if not Path(spec).exists():
        known = ", ".join([*TEXT_DOMAINS, *CHAT_DOMAINS])
        raise FileNotFoundError(f"corpus {spec!r} is neither a built-in domain ({known}) nor an existing path")
    return spec, ""


def _in_calib(key: str) -> bool:
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:4], "big") % CALIB_BUCKETS == 0


def _select(items: list[str], split: str, key=lambda s: s[:4000]) -> list[str]:
    if split == "heldout":
        return items
    return [x for x in items if _in_calib(key(x)) == (split == "calib")]


def domain_texts(name: str, split: str) -> list[str]:
    """Texts of a built-in text domain in one of SPLITS."""
    source = TEXT_DOMAINS[name]
    if split == "heldout":
        return source("heldout")
    return _select(source("train"), split)


def chat_prompts(name: str, split: str, samples: int, seed: int) -> list[str]:
    kind, part = CHAT_DOMAINS[name], "heldout" if split == "heldout" else "train"
    prompts = manpages.unix_prompts(part) if kind == "unix" else corpus.chat_prompts(part, kind)
    prompts = _select(prompts, split, key=lambda s: s)
    random.Random(seed).shuffle(prompts)
    return prompts[:samples]


def load_documents(
    spec: str, tokenizer, cache_dir: Path, large_model=None, chat: ChatGen = ChatGen()
) -> list[Document]:
    """Token documents for one spec. chat-* specs need `large_model` the first time."""
    name, split = parse_spec(spec)
    if name in TEXT_DOMAINS:
        return [Document(tuple(_encode(tokenizer, t))) for t in domain_texts(name, split)]
    if name in CHAT_DOMAINS:
        path = Path(cache_dir) / f"{name}-{split}.jsonl"
        prompts = chat_prompts(name, split, chat.samples, chat.seed)
        generate_answers(prompts, path, tokenizer, large_model, chat)
        return _jsonl_documents(path, tokenizer)
    path = Path(name)
    if path.suffix == ".jsonl":
        return _jsonl_documents(path, tokenizer)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return [Document(tuple(_encode(tokenizer, t))) for t in texts if t.strip()]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _template(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_document(tokenizer, messages: list[dict]) -> Document:
    """The conversation through the chat template; positions = the last assistant turn."""
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("a chat record must end with an assistant message")
    if not getattr(tokenizer, "chat_template", None):
        text = "\n".join(m["content"] for m in messages)
        head = "\n".join(m["content"] for m in messages[:-1]) + "\n"
        return Document(tuple(_encode(tokenizer, text)), max(0, len(_encode(tokenizer, head)) - 1))
    ids = _template(tokenizer, messages, False)
    head = _template(tokenizer, messages[:-1], True)
    return Document(tuple(ids), len(head) - 1)


def _record_messages(record: dict) -> list[dict] | None:
    if "messages" in record:
        return record["messages"]
    if "prompt" in record and "response" in record:
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    return None


def _jsonl_documents(path: Path, tokenizer) -> list[Document]:
    docs = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i + 1}: not JSON ({exc})") from None
        messages = _record_messages(record)
        if messages is not None:
            docs.append(chat_document(tokenizer, messages))
        elif "text" in record:
            docs.append(Document(tuple(_encode(tokenizer, record["text"]))))
        else:
            raise ValueError(f"{path}:{i + 1}: expected 'messages', 'prompt'+'response' or 'text'")
    return docs


@torch.inference_mode()
def generate_answers(prompts: list[str], path: Path, tokenizer, large_model, chat: ChatGen) -> None:
    """Append the large model's sampled answer to each prompt not yet in `path` (resumable)."""
    done = set()
    if path.exists():
        done = {json.loads(line)["messages"][0]["content"] for line in path.read_text().splitlines() if line.strip()}
    todo = [p for p in prompts if p not in done]
    if not todo:
        return
    if large_model is None:
        raise ValueError(f"{path.name} must be generated first: that needs the large model")
    path.parent.mkdir(parents=True, exist_ok=True)
    device = next(large_model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = range(0, len(todo), chat.batch_size)
    for b in tqdm(batches, desc=f"answers -> {path.name}", unit="batch"):
        batch = todo[b : b + chat.batch_size]
        encoded = [_template(tokenizer, [{"role": "user", "content": p}], True) for p in batch]
        width = max(map(len, encoded))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [B, P] left-padded
        mask = torch.zeros_like(ids)
        for i, e in enumerate(encoded):
            ids[i, width - len(e) :] = torch.tensor(e)
            mask[i, width - len(e) :] = 1
        torch.manual_seed(chat.seed * 100003 + b)
        out = large_model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            temperature=chat.temperature,
            top_p=chat.top_p,
            max_new_tokens=chat.max_tokens,
            pad_token_id=pad,
        )
        with path.open("a", encoding="utf-8") as f:
            for prompt, row in zip(batch, out[:, width:].tolist()):
                answer = tokenizer.decode(row, skip_special_tokens=True).strip()
                messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
                f.write(json.dumps({"messages": messages}) + "\n")
