"""The Engine's text side (engine/api.Engine takes it in): tokens, chat templates, prompts of any kind as token
ids, image rows, and the chat positions worth a snapshot."""

from __future__ import annotations

import numpy as np

from ..errors import HybridInferError, ParameterError


def chat_boundaries(messages: list[dict], ids: list[int], render) -> tuple[int, ...]:
    """Token positions in `ids` worth a snapshot in a chat: the end of the leading system messages and the end of
    the history (before the generation prompt). render(messages) gives the tokens of those messages rendered with
    no generation prompt; a position counts only where they are a prefix of `ids`. A template that cannot render
    the system messages alone (some require a user turn) gives no system boundary."""
    from ..errors import TemplateError

    out = []
    k = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))
    for part in ([messages[:k]] if 0 < k < len(messages) else []) + [messages]:
        try:
            h = render(part)
        except TemplateError:
            continue
        if 0 < len(h) < len(ids) and ids[: len(h)] == h:
            out.append(len(h))
    return tuple(sorted(set(out)))


def boundary_points(turn_boundary) -> tuple[int, ...]:
    """A Request's turn_boundary as positions: one int (the end of the history) or a tuple of them."""
    return (turn_boundary,) if isinstance(turn_boundary, int | np.integer) else tuple(turn_boundary)


class Text:
    """Engine's methods over its tokenizer, chat template and image encoder (self.tokenizer, self.gm,
    self.chat_template, self.special_in_content, self.args, self.image_encoder)."""

    def encode_image(self, image) -> np.ndarray:
        """The image's rows for the text model (one per image token, [n_tokens, n_embd] float32), from the mmproj's
        tower; the same image again comes from the embedding cache (engine/images.ImageStore). `image`: a path,
        bytes, a data: URL or a PIL image (format/image_input.open_image)."""
        if self.image_encoder is None:
            raise ParameterError("this engine has no vision tower: load it with mmproj=PATH (--mmproj)")
        from .images import embed

        return embed(self, [image])[0].rows

    # tokens ---------------------------------------------------------------------------------------
    def _tok(self):
        if self.tokenizer is None:
            raise HybridInferError(f"{self.gm.path!r} has no vocabulary; pass token ids instead of text")
        return self.tokenizer

    def tokenize(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        return self._tok().encode(text, add_bos=add_bos, parse_special=parse_special)

    def detokenize(self, ids) -> str:
        return self._tok().decode([int(i) for i in ids])

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    enable_thinking: bool | None = None, tools=None) -> str:
        return self.chat_text(messages, add_generation_prompt, enable_thinking, tools).text

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True,
                  enable_thinking: bool | None = None, tools=None):
        """The rendered chat as a format.chat_text.ChatText: its text, and where the messages' and tools' text
        holds control tokens' text (tokenized as text by `tokenize_chat` unless special_in_content)."""
        from ..format.chat_text import render_for
        from .images import chat_markup

        messages, put = chat_markup(messages)  # image parts: each its slot, as template markup (engine/images.py)
        return put(render_for(self._tok(), self.chat_template or self.gm.meta("tokenizer.chat_template", None),
                              messages, tools, guarded=not self.special_in_content,
                              add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking))

    def tokenize_chat(self, chat) -> list[int]:
        """Token ids of a ChatText (no second BOS where the template wrote one; its spans tokenized as text)."""
        from ..format.chat_text import encode_chat

        return encode_chat(self._tok(), chat)

    def encode_prompt(self, prompt, enable_thinking: bool | None = None) -> list[int]:
        """A str is completed raw; a list of {role, content} messages is chat-templated; a list of ints
        is taken as token ids."""
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int | np.integer) for t in prompt):
            return self._check_ids([int(t) for t in prompt])
        if isinstance(prompt, list | tuple) and all(isinstance(m, dict) for m in prompt):
            return self._encode_chat(prompt, enable_thinking)
        raise TypeError(f"prompt must be a str, a list of messages or a list of token ids, not "
                        f"{type(prompt).__name__}")

    def _check_ids(self, ids: list[int]) -> list[int]:
        bad = next((i for i in ids if not 0 <= i < self.args.n_vocab), None)
        if bad is not None:
            raise ParameterError(f"token id {bad} is outside the vocabulary [0, {self.args.n_vocab})")
        return ids

    def _encode_chat(self, messages, enable_thinking, add_generation_prompt: bool = True) -> list[int]:
        return self.tokenize_chat(self.chat_text(list(messages), add_generation_prompt, enable_thinking))

    def _turn_boundary(self, prompt, ids: list[int], enable_thinking) -> tuple[int, ...] | None:
        """For a chat prompt: where the generation prompt starts (the history before it is the next turn's
        prefix) and where the leading system messages end (shared by every conversation with that system prompt
        and tools), each where the rendered part's tokens are a prefix of `ids`."""
        if not (isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt)):
            return None
        render = lambda msgs: self._encode_chat(msgs, enable_thinking, add_generation_prompt=False)  # noqa: E731
        return chat_boundaries(list(prompt), ids, render) or None
