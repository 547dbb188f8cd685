"""One tier serves one model. Roles join a tier by its Redis URL and prefix alone,
so a worker started with another `--model` would tokenize, run or decode with the
wrong vocabulary: every response it touched garbled, and nothing failing. Each
role names its model's fingerprint in its liveness record and refuses to join a
tier whose live workers run another; a scheduler refuses a Submit tokenized for
another (a race of two starting at once)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from pipeline.errors import ConfigError
from pipeline.models import ModelFiles
from pipeline.status import read_live_workers
from pipeline.streams import StreamClient
from pipeline.tokenizer import Tokenizer

# what a scheduler's forward pass depends on, of config.json: two checkpoints that
# agree on these and on the vocabulary are one model to the tier (a fine-tune of the
# same base is not told apart; its weights are not hashed: gigabytes at every start)
SHAPE_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "rope_theta", "rope_scaling", "tie_word_embeddings")


@dataclass(frozen=True)
class ModelIdentity:
    name: str  # the model's name on this worker (a directory's may differ by host)
    fingerprint: str  # what must agree across the tier

    def record(self) -> dict:
        """The liveness record's fields."""
        return {"model": self.name, "fingerprint": self.fingerprint}


def identify(model: ModelFiles, tokenizer: Tokenizer) -> ModelIdentity:
    """The vocabulary (every token's id, added tokens too) and the architecture's
    shape, hashed: the same on every host that has the same model, in whatever
    directory and whichever library version wrote its files."""
    config = json.loads((model.path / "config.json").read_text())
    shape = {key: config.get(key) for key in SHAPE_KEYS}
    vocab = sorted(tokenizer.vocab().items(), key=lambda item: item[1])
    text = json.dumps([shape, vocab], sort_keys=True, ensure_ascii=False)
    return ModelIdentity(model.name, hashlib.sha256(text.encode()).hexdigest()[:16])


def strangers(workers: list[dict], fingerprint: str) -> list[dict]:
    """The live workers that name another model (a worker older than the
    fingerprint names none: it is given the benefit of the doubt)."""
    return [w for w in workers if w.get("fingerprint") not in (None, fingerprint)]


async def check_tier_model(client: StreamClient, prefix: str, identity: ModelIdentity,
                           role: str) -> None:
    """ConfigError where the tier's live workers run another model than `identity`."""
    await client.clock.sync(client.redis)  # the workers index is on the tier's clock
    found = strangers(await read_live_workers(client, prefix), identity.fingerprint)
    if found:
        other = found[0]
        raise ConfigError(
            f"tier {prefix!r} serves model {other.get('model')!r} (fingerprint "
            f"{other['fingerprint']}, on {other.get('role')} {other.get('id')} and "
            f"{len(found) - 1} more); this {role} loaded {identity.name!r} "
            f"({identity.fingerprint}). One tier serves one model: start it with that "
            f"model, or give it another --prefix (a stopped worker's record lasts "
            f"--alive-ttl-s)")
