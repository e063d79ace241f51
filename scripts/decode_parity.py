"""Native decode against transformers' decode on the accuracy suite's passkey prompts (FullKV, fp32, greedy).

For each prompt, transformers generates greedily; the native session is then teacher-forced along those
tokens (its prefill, then one decode step per token), and the script prints the first step whose native
argmax differs, the two top-1 minus top-2 logit margins there, and the largest |logit difference| over all
steps. Answers issue #43's question whether the native decoder leaving transformers' tokens is a near-tie
or a decode-path difference.

Usage: python scripts/decode_parity.py [--cases 12] [--length 2000] [--new 64] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch

from beaconkv.hf.generation import load_hf_model
from beaconkv.measure.accuracy.tasks import make_cases
from beaconkv.models.embedded import embedded_model_path
from beaconkv.models.loading import load_model
from beaconkv.session import Session
from beaconkv.tokenizer import load_tokenizer


def main() -> None:
    """Prints one line per prompt."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=12, help="passkey prompts (default 12)")
    parser.add_argument("--length", type=int, default=2000, help="filler tokens of each prompt (default 2000)")
    parser.add_argument("--new", type=int, default=64, help="greedy tokens per prompt (default 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = embedded_model_path()
    tokenizer = load_tokenizer(path)
    native = load_model(path, dtype=torch.float32)
    hf = load_hf_model(str(path), dtype=torch.float32, device="cpu")
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    for case in make_cases("passkey", args.length, args.cases, count):
        ids = tokenizer.encode(case.context + case.question)
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=args.new, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(ids):].tolist()
        reference = torch.stack([s[0].float() for s in out.scores])
        session = Session.for_prompts(native, None, [len(ids)], len(tokens))
        steps = [session.prefill([ids])[0]]
        steps += [session.step_logits(torch.tensor([t]))[0] for t in tokens[:-1]]
        logits = torch.stack(steps)
        diff = (logits - reference).abs().max().item()
        first = next((i for i, t in enumerate(tokens) if logits[i].argmax().item() != t), None)
        head = f"case {case.index}: {len(ids)} prompt tokens, "
        if first is None:
            print(f"{head}{len(tokens)} greedy tokens equal, max |logit diff| {diff:.2e}")
            continue
        margin = [(x[0] - x[1]).item() for x in (reference[first].topk(2).values, logits[first].topk(2).values)]
        print(f"{head}argmax differs at step {first}: top1-top2 transformers {margin[0]:.2e}, native "
              f"{margin[1]:.2e}; max |logit diff| {diff:.2e}")


if __name__ == "__main__":
    main()
