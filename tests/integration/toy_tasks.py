"""A task that a tiny model learns by RL in about a minute: repeat the letter of the prompt.

The prompt is a number (so that no two items read the same) and a letter; the reward is
the share of the first LENGTH characters of the completion that are that letter. From
random weights RL does not find it (samples almost never hold the letter, and the few
that do teach the model one letter for every prompt), so the test starts, like the real
recipes, from a short supervised warm start that leaves the model far from solving it.
"""

import random

LETTERS = "abcd"
LENGTH = 8


def letter_items(size: int, seed: int, **_) -> list[dict]:
    rng = random.Random(f"letters-{seed}")
    items = []
    for i in range(size):
        c = rng.choice(LETTERS)
        items.append({"id": f"letter-{seed}-{i}", "question": f"{rng.randrange(10**6)} {c}",
                      "answer": c, "task": "letter"})
    return items


def repeat_letter(completion: str, item: dict) -> float:
    return completion[:LENGTH].count(item["answer"]) / LENGTH


def warm_start(model_path: str, out: str, steps: int, lr: float = 1e-3, batch: int = 16) -> str:
    """`steps` of supervised training on right answers, saved to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    items = letter_items(steps * batch, seed=12345)
    for s in range(steps):
        rows, masks = [], []
        for item in items[s * batch:(s + 1) * batch]:
            text = tok.apply_chat_template([{"role": "user", "content": item["question"]}],
                                           add_generation_prompt=True, tokenize=False)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            answer = tok(item["answer"] * LENGTH, add_special_tokens=False)["input_ids"]
            rows.append(list(prompt) + answer)
            masks.append([0] * len(prompt) + [1] * len(answer))
        width = max(map(len, rows))
        ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
