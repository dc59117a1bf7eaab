"""The verification suffix and the judge's labels, from the target's own
tokenizer and chat template.

The suffix is what the target's chat template puts between the end of an
assistant answer and the first token of the next assistant answer, when the
next user turn is the verification question: for ChatML that is
`<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n`.
Templates with a reasoning mode render the reply opening with reasoning off
(`enable_thinking=False`: for Qwen3 the suffix ends with an empty
`<think>\n\n</think>\n\n`), so the judge's next token is its answer, not
`<think>`. The suffix is tokenized once, without special-token insertion,
and appended after every judged prefix.

Each label is scored as its whole token sequence, tokenized where the judge
reads it (right after the suffix): log P(label) = Σ_j log P(label_j | suffix,
label_<j). One copy of the pass serves both labels when at most one of them
is more than one token: that label's tokens but its last are appended to
the suffix, and the logits at the suffix's last token and at each appended
token give every factor. Worked example (SmolLM2: "Correct" = [Correct],
"Incorrect" = [In, correct]):

    copy tokens:  ... <|im_start|> assistant \\n   In
    logits row:                              r0   r1
    log P(Correct)   = log_softmax(r0)[Correct]
    log P(Incorrect) = log_softmax(r0)[In] + log_softmax(r1)[correct]

Two labels of several tokens each would need two sequences per judged
prefix; they are refused with a message naming the label tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parse_vllm.config import ParseConfig, ParseConfigError

# A placeholder answer that no chat template rewrites and no tokenizer merges
# with its neighbours; everything the template emits after it is the suffix.
_SENTINEL = "PARSE_ANSWER_SENTINEL_7f3a"

# Passed to every chat template: templates with a reasoning mode (Qwen3,
# and others using the same variable) then open the judge's reply with its
# answer. Templates that don't know the variable ignore it.
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}


@dataclass(frozen=True)
class LabelScoring:
    """log P(label) of both labels from the logits at the end of each copy."""

    yes_ids: tuple[int, ...]  # labels[0] ("Correct") as read after the suffix
    no_ids: tuple[int, ...]  # labels[1] ("Incorrect")
    # The tokens appended to the chat suffix: the longer label but its last
    # token (empty when both labels are single tokens).
    extension: tuple[int, ...]

    @property
    def rows(self) -> int:
        """Logits rows read per copy: its last `rows` positions."""
        return len(self.extension) + 1

    def row_index(self, last: torch.Tensor) -> torch.Tensor:
        """[C] index of each copy's last token -> [C * rows] indices of the
        rows to read, copy-major."""
        offsets = torch.arange(1 - self.rows, 1, device=last.device, dtype=last.dtype)
        return (last[:, None] + offsets[None, :]).reshape(-1)

    def log_probs(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [C * rows, vocab] (rows from `row_index`) -> (log P(yes) [C],
        log P(no) [C]), float32."""
        lp = torch.log_softmax(logits.float(), dim=-1).view(-1, self.rows, logits.shape[-1])
        return self._label(lp, self.yes_ids), self._label(lp, self.no_ids)

    @staticmethod
    def _label(lp: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
        # Label token j is predicted by row j (row 0: the suffix's last token); indexed by
        # Python ints, so nothing is copied to the device.
        return sum(lp[:, j, t] for j, t in enumerate(ids))


@dataclass(frozen=True)
class VerificationTemplate:
    suffix_text: str  # the chat template's text between answer and reply
    suffix_ids: tuple[int, ...]  # [L] appended after every judged prefix (with the label extension)
    labels: LabelScoring

    @property
    def suffix_len(self) -> int:
        return len(self.suffix_ids)

    @property
    def chat_suffix_ids(self) -> tuple[int, ...]:
        """The chat suffix alone, without the label extension: the judgment (zero-shot or a
        judge head) is read at its last token."""
        return self.suffix_ids[: len(self.suffix_ids) - len(self.labels.extension)]


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **CHAT_TEMPLATE_KWARGS
    )


def suffix_text_from_chat_template(tokenizer, question: str) -> str:
    """Close the assistant turn, ask `question` as the user, open a new
    assistant turn with reasoning off — in the target's own chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ParseConfigError(
            "the target tokenizer has no chat template, which PARSE needs to "
            "build its verification question; use an instruct/chat model or "
            "set a chat template on its tokenizer"
        )
    messages = [
        {"role": "user", "content": "Question."},
        {"role": "assistant", "content": _SENTINEL},
        {"role": "user", "content": question},
    ]
    text = _render(tokenizer, messages, add_generation_prompt=True)
    pos = text.find(_SENTINEL)
    if pos < 0:
        raise ParseConfigError(
            "the target's chat template drops earlier assistant turns, so "
            "PARSE cannot place its verification question after an answer"
        )
    suffix = text[pos + len(_SENTINEL) :]
    if question not in suffix:
        raise ParseConfigError("the chat template did not keep the verification question")
    return suffix


def label_scoring(tokenizer, suffix_text: str, suffix_ids: tuple[int, ...], labels: tuple[str, str]) -> LabelScoring:
    """Each label's tokens as the judge reads them after the suffix (tokenized
    together with it, so a tokenizer that adds a space or merges across the
    join is seen as it is)."""
    ids = []
    for label in labels:
        toks = tuple(tokenizer.encode(suffix_text + label, add_special_tokens=False))
        if toks[: len(suffix_ids)] != suffix_ids or len(toks) == len(suffix_ids):
            raise ParseConfigError(
                f"parse.labels: {label!r} does not tokenize as separate tokens after the "
                f"verification suffix (it merges with the suffix's end {suffix_text[-12:]!r}); "
                "pick another label"
            )
        ids.append(toks[len(suffix_ids) :])
    yes, no = ids

    def shown(t):
        return [tokenizer.decode([x]) for x in t]

    if yes[0] == no[0]:
        raise ParseConfigError(
            f"parse.labels: {labels[0]!r} {shown(yes)} and {labels[1]!r} {shown(no)} start with "
            "the same token; pick labels that start with different tokens"
        )
    if len(yes) > 1 and len(no) > 1:
        raise ParseConfigError(
            f"parse.labels: {labels[0]!r} is {len(yes)} tokens {shown(yes)} and {labels[1]!r} is "
            f"{len(no)} tokens {shown(no)} for this tokenizer; at most one label may be more than "
            "one token (one verification copy scores both labels whole only then); pick a "
            'one-token label for one of them, e.g. "Yes"/"No"'
        )
    longer = yes if len(yes) > 1 else no
    return LabelScoring(yes_ids=yes, no_ids=no, extension=longer[:-1])


def build_template(tokenizer, config: ParseConfig) -> VerificationTemplate:
    suffix_text = suffix_text_from_chat_template(tokenizer, config.question)
    chat_ids = tuple(tokenizer.encode(suffix_text, add_special_tokens=False))
    if not chat_ids:
        raise ParseConfigError("the verification suffix tokenizes to nothing")
    labels = label_scoring(tokenizer, suffix_text, chat_ids, config.labels)
    return VerificationTemplate(suffix_text, chat_ids + labels.extension, labels)
