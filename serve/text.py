"""Text for the OpenAI routes: detokenising a stream with stop strings, the control-token
texts a user may not send, and names that show no server paths."""

from pathlib import Path


class IncrementalText:
    """Token ids -> text pieces that are safe to send, cut at the first stop string.

    Text that could still become a stop string (a suffix that is a prefix of one) or an
    unfinished UTF-8 character ("\\ufffd" at the end) is held back until it resolves.
    Example, stop ["\\n\\n"]: text "Hi\\n" sends "Hi" and holds "\\n"; "Hi\\n\\nBye" stops at "Hi".
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned
        self.stopped = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        text = self._text()
        if self.stops:
            longest = max(len(s) for s in self.stops)
            start = max(0, self.sent - longest + 1)
            hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                end = max(min(hits), self.sent)
                self.stopped = True
                piece, self.sent = text[self.sent:end], end
                return piece
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        if text.endswith("\ufffd"):
            hold = max(hold, 1)
        end = max(self.sent, len(text) - hold)
        piece, self.sent = text[self.sent:end], end
        return piece

    def flush(self) -> str:
        """What is left once generation ended without a stop string."""
        if self.stopped:
            return ""
        text = self._text()
        piece, self.sent = text[self.sent:], len(text)
        return piece


def public_name(path: str | None, parent: str | None = None) -> str | None:
    """A drafter/corpus source as /v1/models shows it: no server paths. A file inside
    `parent` (the drafter directory) is named relative to the parent's name."""
    if path is None or path in ("random",):
        return path
    p = Path(path)
    if parent not in (None, "random"):
        try:
            return str(Path(Path(parent).name) / p.relative_to(parent))
        except ValueError:
            pass
    return p.name


def special_token_texts(tokenizer) -> list[str]:
    """Texts the tokenizer turns into control tokens (<|im_start|>, ...), longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            texts.add(str(tok.content))
    return sorted((t for t in texts if t), key=len, reverse=True)
