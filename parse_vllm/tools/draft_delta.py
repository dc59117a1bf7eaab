"""A trained draft as it ships: a *delta* over its target, and the draft rebuilt from it.

``parse-vllm train-draft`` writes the draft without the weights it shares with the target
(:data:`SHARED_WEIGHTS`, the token embedding) in a folder of three files
(:func:`export_delta`); :func:`assemble_draft` joins such a folder with the target's
embedding and tokenizer files into a normal HF folder vLLM loads. ``parse-vllm
prepare-models`` assembles the shipped draft (``parse_vllm/drafts/``) this way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from parse_vllm.draft_vocab import HEAD_IDS_KEY

__all__ = ["DELTA_CONFIG", "DELTA_META", "DELTA_WEIGHTS", "SHARED_WEIGHTS", "assemble_draft", "export_delta"]

#: Weights that belong to the target and are shared, never trained or shipped.
SHARED_WEIGHTS = ("model.embed_tokens.weight",)

DELTA_WEIGHTS = "draft_delta.safetensors"  # the draft's own tensors (bf16; a pruned head's ids, int64)
DELTA_CONFIG = "config.json"  # the draft's config.json as it is assembled
DELTA_META = "training.json"  # how it was made (train-draft's record)


def export_delta(model, dcfg: dict, out: Path, meta: dict, head_ids=None) -> None:
    """The draft minus the shared embedding, in bf16: what gets shipped (a head-pruned
    draft also ships its head's token ids ``head_ids``, int64)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {
        k: v.detach().to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if k not in SHARED_WEIGHTS and k != "lm_head.weight"
    }
    if head_ids is not None:
        sd[HEAD_IDS_KEY] = head_ids.contiguous()
    save_file(sd, str(out / DELTA_WEIGHTS), metadata={"shared_from_target": ",".join(SHARED_WEIGHTS)})
    (out / DELTA_CONFIG).write_text(json.dumps(dcfg, indent=2) + "\n")
    (out / DELTA_META).write_text(json.dumps(meta, indent=2) + "\n")


def assemble_draft(delta_dir: Path, target_dir: Path, out: Path) -> Path:
    """A normal HF folder: the delta's weights + the target's embedding and tokenizer files."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    sd = load_file(str(delta_dir / DELTA_WEIGHTS))
    dcfg = json.loads((delta_dir / DELTA_CONFIG).read_text())
    tcfg = json.loads((target_dir / "config.json").read_text())
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads"):
        if dcfg.get(key) != tcfg.get(key):
            raise ValueError(
                f"draft {delta_dir} was trained for another target: {key} "
                f"{dcfg.get(key)} != {tcfg.get(key)} in {target_dir}"
            )
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        for name in SHARED_WEIGHTS:
            sd[name] = f.get_tensor(name).to(torch.bfloat16)
    if HEAD_IDS_KEY in sd:  # the head's rows are the shared embedding's rows
        sd["lm_head.weight"] = sd[SHARED_WEIGHTS[0]][sd[HEAD_IDS_KEY]].contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dcfg, indent=2) + "\n")
    for f in target_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in (
            "chat_template.jinja",
            "special_tokens_map.json",
            "generation_config.json",
        ):
            shutil.copy2(f, out / f.name)
    shutil.copy2(delta_dir / DELTA_META, out / DELTA_META)
    return out
