"""Text <-> token ids: a Hugging Face `tokenizer.json`, or a byte-level fallback."""

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """What the API server needs from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt (with the model's special prefix, if any)."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """Text of completion tokens (special tokens dropped)."""
        ...


class ByteTokenizer:
    """Fallback: token id `b` is the byte `b` (0-255); higher ids are special and decode to ''.

    Args:
        bos_token_id: prepended to every encoded prompt when set.
    """

    def __init__(self, bos_token_id: int | None = None) -> None:
        self.bos_token_id = bos_token_id

    def encode(self, text: str) -> list[int]:
        prefix = [] if self.bos_token_id is None else [self.bos_token_id]
        return prefix + list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` package."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tokenizer = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


def load_tokenizer(model: str, bos_token_id: int | None = None) -> Tokenizer:
    """The tokenizer of a `--model` value: its `tokenizer.json` if any, else bytes.

    Args:
        model: `tiny` or a Hugging Face directory.
        bos_token_id: prefix of the byte-level fallback's prompts.
    """
    path = Path(model) / "tokenizer.json"
    if model != "tiny" and path.is_file():
        return HFTokenizer(path)
    return ByteTokenizer(bos_token_id)
