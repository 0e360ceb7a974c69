"""Deterministic multi-turn chat workloads for the tree, tier and trace benchmarks.

``multi_turn(seed)`` builds, from one seed (numpy's PCG64, so the same tokens on every
machine):

* 20 system prompts of 850-1,200 tokens;
* 200 conversations, each on a random system prompt, of 10 turns adding 150-300 tokens
  each. Inserting the whole conversation after every turn gives 2,000 inserts, in a
  random interleaving that keeps each conversation's turns in order;
* 10,000 lookups: half exact repeats of inserted sequences, a quarter an inserted
  sequence plus 200 new tokens, a quarter a new conversation (150-300 new tokens) on a
  known system prompt.

Token ids are below 128,000. Sequences are int32 numpy arrays; ``packed`` gives them as
the little-endian int32 bytes that hicache takes on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = 128_000


@dataclass(frozen=True)
class Conversation:
    system_prompt: int
    turns: tuple[np.ndarray, ...]  # the tokens each turn adds

    def sequence(self, prompts: tuple[np.ndarray, ...], num_turns: int) -> np.ndarray:
        """The whole conversation after ``num_turns`` turns, system prompt first."""
        return np.concatenate((prompts[self.system_prompt], *self.turns[:num_turns]))


@dataclass(frozen=True)
class Workload:
    seed: int
    system_prompts: tuple[np.ndarray, ...]
    conversations: tuple[Conversation, ...]
    inserts: tuple[np.ndarray, ...]
    insert_order: tuple[tuple[int, int], ...]  # (conversation, turns so far) per insert
    lookups: tuple[np.ndarray, ...]
    lookup_kinds: tuple[str, ...]  # "repeat", "extend" or "new"

    @property
    def num_tokens_inserted(self) -> int:
        return sum(len(s) for s in self.inserts)


def packed(sequences: tuple[np.ndarray, ...]) -> list[bytes]:
    return [np.ascontiguousarray(s, dtype="<i4").tobytes() for s in sequences]


def multi_turn(
    seed: int = 0,
    *,
    num_system_prompts: int = 20,
    system_prompt_tokens: tuple[int, int] = (850, 1200),
    num_conversations: int = 200,
    num_turns: int = 10,
    turn_tokens: tuple[int, int] = (150, 300),
    num_lookups: int = 10_000,
    extend_tokens: int = 200,
) -> Workload:
    rng = np.random.Generator(np.random.PCG64(seed))

    def tokens(lo: int, hi: int) -> np.ndarray:
        return rng.integers(0, VOCAB, size=int(rng.integers(lo, hi + 1)), dtype=np.int32)

    prompts = tuple(tokens(*system_prompt_tokens) for _ in range(num_system_prompts))
    conversations = tuple(
        Conversation(
            int(rng.integers(0, num_system_prompts)),
            tuple(tokens(*turn_tokens) for _ in range(num_turns)),
        )
        for _ in range(num_conversations)
    )

    # Random interleaving: each step advances a random unfinished conversation by a turn.
    progress = [0] * num_conversations
    active = list(range(num_conversations))
    order: list[tuple[int, int]] = []
    while active:
        slot = int(rng.integers(0, len(active)))
        conv = active[slot]
        progress[conv] += 1
        order.append((conv, progress[conv]))
        if progress[conv] == num_turns:
            active[slot] = active[-1]
            active.pop()
    inserts = tuple(conversations[c].sequence(prompts, t) for c, t in order)

    lookups: list[np.ndarray] = []
    kinds: list[str] = []
    for _ in range(num_lookups):
        draw = rng.random()
        if draw < 0.5:
            lookups.append(inserts[int(rng.integers(0, len(inserts)))])
            kinds.append("repeat")
        elif draw < 0.75:
            base = inserts[int(rng.integers(0, len(inserts)))]
            fresh = rng.integers(0, VOCAB, size=extend_tokens, dtype=np.int32)
            lookups.append(np.concatenate((base, fresh)))
            kinds.append("extend")
        else:
            prompt = prompts[int(rng.integers(0, num_system_prompts))]
            lookups.append(np.concatenate((prompt, tokens(*turn_tokens))))
            kinds.append("new")
    return Workload(
        seed, prompts, conversations, inserts, tuple(order), tuple(lookups), tuple(kinds)
    )
