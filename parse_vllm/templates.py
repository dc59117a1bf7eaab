"""The verification suffix and the judge's label tokens, from the target's own
tokenizer and chat template.

The suffix is what the target's chat template puts between the end of an
assistant answer and the first token of the next assistant answer, when the
next user turn is the verification question: for ChatML that is
`<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n`.
It is tokenized once, without special-token insertion, and appended after
every judged prefix; the next-token distribution at its last token compares
the two labels.
"""

from __future__ import annotations

from dataclasses import dataclass

from parse_vllm.config import ParseConfig, ParseConfigError

# A placeholder answer that no chat template rewrites and no tokenizer merges
# with its neighbours; everything the template emits after it is the suffix.
_SENTINEL = "PARSE_ANSWER_SENTINEL_7f3a"


@dataclass(frozen=True)
class VerificationTemplate:
    suffix_text: str
    suffix_ids: tuple[int, ...]  # [L] appended after every judged prefix
    yes_id: int  # first token of labels[0] ("Correct")
    no_id: int  # first token of labels[1] ("Incorrect")

    @property
    def suffix_len(self) -> int:
        return len(self.suffix_ids)


def suffix_text_from_chat_template(tokenizer, question: str) -> str:
    """Close the assistant turn, ask `question` as the user, open a new
    assistant turn — in the target's own chat template."""
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
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    pos = text.find(_SENTINEL)
    if pos < 0:
        raise ParseConfigError(
            "the target's chat template drops earlier assistant turns, so "
            "PARSE cannot place its verification question after an answer"
        )
    suffix = text[pos + len(_SENTINEL):]
    if question not in suffix:
        raise ParseConfigError("the chat template did not keep the verification question")
    return suffix


def label_token_ids(tokenizer, labels: tuple[str, str]) -> tuple[int, int]:
    """First token of each label as the start of an assistant reply; refuses
    labels whose first tokens coincide (their probabilities would be equal)."""
    ids = []
    for label in labels:
        toks = tokenizer.encode(label, add_special_tokens=False)
        if not toks:
            raise ParseConfigError(f"parse.labels: label {label!r} tokenizes to nothing")
        ids.append(toks[0])
    if ids[0] == ids[1]:
        raise ParseConfigError(
            f"parse.labels: {labels[0]!r} and {labels[1]!r} share their first token "
            f"({ids[0]}: {tokenizer.decode([ids[0]])!r}); pick labels that "
            "start with different tokens"
        )
    return ids[0], ids[1]


def build_template(tokenizer, config: ParseConfig) -> VerificationTemplate:
    suffix_text = suffix_text_from_chat_template(tokenizer, config.question)
    suffix_ids = tuple(tokenizer.encode(suffix_text, add_special_tokens=False))
    if not suffix_ids:
        raise ParseConfigError("the verification suffix tokenizes to nothing")
    yes_id, no_id = label_token_ids(tokenizer, config.labels)
    return VerificationTemplate(suffix_text, suffix_ids, yes_id, no_id)
