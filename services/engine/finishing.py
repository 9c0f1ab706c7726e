"""When a request is done: SGLang's finish checks (abort, length, stop token / EOS, stop string or regex)."""

from __future__ import annotations

import re
from typing import Any

from rlmesh.engine.protocol import GenerationRequest


class FinishChecker:
    """Checked after every token in SGLang's order (`Req.check_finished`). Used only by
    the worker thread; it caches each stop string's length in tokens."""

    def __init__(self, tokenizer: Any, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self._stop_len: dict[str, int] = {}  # stop string -> its length in tokens (for tail decoding)

    def reason(self, req: GenerationRequest) -> dict[str, Any] | None:
        """The finish_reason if req is done after its newest token, else None."""
        p = req.params
        if req.abort_message:
            return {"type": "abort", "message": req.abort_message}
        if len(req.output_ids) >= req.max_new_tokens:
            return {"type": "length", "length": req.max_new_tokens}
        last = req.output_ids[-1]
        if not p.ignore_eos and (last in p.stop_token_ids or last in self.eos_ids):
            return {"type": "stop", "matched": last}
        if p.stop or p.stop_regex:
            tail = self._tail_text(req)
            for stop in p.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
            for pattern in p.stop_regex:
                found = re.search(pattern, tail)
                if found:
                    return {"type": "stop", "matched": found.group(0)}
        return None

    def _tail_text(self, req: GenerationRequest) -> str:
        """Decoded text of the last few output tokens: enough to contain any stop string
        that the newest token completed."""
        p = req.params
        longest = 0
        for stop in p.stop:
            if stop not in self._stop_len:
                self._stop_len[stop] = len(self.tokenizer.encode(stop, add_special_tokens=False))
            longest = max(longest, self._stop_len[stop])
        # A regex may match anything: look at the whole output.
        ids = req.output_ids if p.stop_regex else req.output_ids[-(longest + 2) :]
        return self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
