"""06 - Analysis: numerical checks of the paper's lemmas, and the entropy-phase analysis of training logs.

Notation. A response y = (y_1..y_L) follows a prompt. At response position k the backbone gives the last-layer hidden
state h_k (size d), the unembedding W (V x d, the lm_head weight, untied here) gives logits z_k = W h_k and
q_k = softmax(z_k). l(y) = sum_k log q_k[y_k] is the trajectory log-likelihood, g = grad_theta l its gradient, and
theta = the LoRA parameters (the "backbone" part) + W. e_v is the one-hot vector of token v.

Lemma 3.2 (gradient inner products).  grad_W log q_k[y_k] = (e_{y_k} - q_k) h_k^T, so for responses i, j
    <g_i, g_j> = sum_{k,k'} <e_{y_ik} - q_ik, e_{y_jk'} - q_jk'> <h_ik, h_jk'>      (W term)
               + <g_i^B, g_j^B>,  g^B = sum_k J_k^T W^T (e_{y_k} - q_k)               (backbone term)
    where dl/dh_k = W^T (e_{y_k} - q_k) and J_k = dh_k / dtheta_backbone.
Lemma 3.3 (mean log-likelihood drift). One gradient-ascent step on the GRPO objective (1/G) sum_j A_j l_j,
    theta' = theta + eta (1/G) sum_j A_j g_j          (= a descent step on L_RL = -(1/G) sum_j A_j l_j)
    (1/G) sum_i [l_i(theta') - l_i(theta)] = (1/G) sum_i <g_i, theta' - theta> + O(eta^2)
                                           = (eta/G) sum_j A_j c_j + O(eta^2),   c_j = (1/G) sum_i <g_i, g_j>.
    (The 1/G in front comes with the 1/G of the mean objective; with L_RL = -sum_j A_j l_j it is eta sum_j A_j c_j.
    A positive constant either way: the sign of sum_j A_j c_j decides whether likelihoods rise.)
Lemma 3.4 (entropy dynamics). For any smooth path pi_t over a finite set, with H = -sum_y pi log pi,
    dH/dt = -sum_y pi (log pi + 1) dlog pi/dt = -Cov_{y~pi}(log pi(y), dlog pi(y)/dt)   (as E_pi[dlog pi/dt] = 0)
    checked (a) on softmax(z) with a logit velocity dz/dt, (b) per token over the vocabulary of the live model under
    the parameter velocity dtheta/dt = -grad L_GRPO (forward-mode JVP, finite differences as a cross-check).
EMPG Proposition 1 (logit space). grad_z log pi(a) = e_a - pi, hence
    E_{a~pi} ||grad_z log pi(a)||^2 = 1 - 2 sum pi^2 + sum pi^2 = 1 - sum_a pi(a)^2 = 1 - exp(-H_2(pi)).
Its open question in parameter space: per step, ||grad_theta log pi(response)||^2 vs the step's mean token entropy;
    reported as Pearson and Spearman correlations (a measurement, not a test).

The checks run in float64 with eager attention (forward-mode AD is not implemented for the fused SDPA kernels).
The figures are drawn by helpers/plots.py from the numbers computed here; helpers/report.py reads the run logs and
writes summary.md, table.md and the JSON files.

Log analysis (--runs): H_u = the mean token entropy of update u's rollouts (metrics.jsonl), s = its centred moving
average over w updates. The threshold, from a no-learning control run (--control, an --lr 0 run on the same seeds):
    sd_c = sd_u(H_u - H_{u-1}) / sqrt(2),   thr = k sd_c sqrt(2 / w),   k = 4, w = 5    (--rise_sd, --smooth)
(4 sd of a difference of two w-update means of pure noise: 0.12 false eruptions per 150 updates of iid noise);
without a control, thr = rise * (max s - min s) (or an absolute --rise_abs), which finds "eruptions" in noise.
Phases, walking forward in u:
    eruption starts at the trough lo once s_u - s_lo > thr (lo = running minimum since the last phase change);
    its peak is confirmed once s_u < s_peak - thr -> subsidence, which ends when s falls back to s_start (or at the
    trough of the next eruption); every other update is descent. Eruption interval = (start, peak, end).
The lemma checks take h_k at the positions whose logits give q_k (Policy(..., logit_states=True)); the rollouts'
hidden_mean, like SEAL's head, averages the states at the response tokens y_k themselves (one position later).
Separation of the trajectory-mean hidden states hbar (hidden_mean averaged over an episode's steps), correct vs wrong:
    Fisher ratio S = ||mu_c - mu_w||^2 / (tr Sigma_c + tr Sigma_w),   Sigma = (1/n) sum (hbar - mu)(hbar - mu)^T
    (scale-free; 0 = same means; grows as the classes pull apart relative to their spread). Maps: top-2 PCA by SVD.
    Its null: the same ratio with the correct/wrong labels shuffled (same counts, 200 times); p = the share of
    shuffles at least as separated (separation-null.json beside separation.json, and summary.md).
Gradient interference (Lemma 3.3 per sample) at a checkpoint, on G saved steps j with advantages A_j:
    c_j = (1/G) sum_i <g_i, g_j>, g_j = grad_LoRA l_j;  (1/G) sum_j A_j c_j > 0 <=> a GRPO step raises mean l_i.

    python 06_analysis.py                          # random-init tiny Qwen2 + LoRA -> runs/analysis/lemmas.json
    python 06_analysis.py --model base/tiny        # the same checks on a saved checkpoint as well
    python 06_analysis.py --runs runs/grpo-webshop-s0,runs/grpo+seal-webshop-s0    # plots + summary.md
    python 06_analysis.py --runs runs/grpo-webshop-s0 --control runs/lr0-webshop-s0   # threshold from the control
    python 06_analysis.py --runs runs/grpo-webshop-s0 --interference               # + c_j vs A_j at the checkpoint
    python 06_analysis.py --results results/matrix   # an experiment's figures and tables from its committed logs:
        table.md (a SEAL run at an alpha other than 0.02 is its own algorithm; a run's held-out score is its pass on
        the most tasks; then C4 and C3 tallied over every run's snapshot measurements), entropy-grid.png (algorithm
        x seed, the control in grey), c4-snapshots.png, summary.md and the plots above
"""
import importlib
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, asdict
from types import SimpleNamespace

import torch
import torch.nn.functional as Fn

from helpers.plots import (plot_entropy, plot_hidden, plot_interference, plot_overlay, plot_rescore, plot_rows,
                           plot_separation, plot_tallies, pyplot, save, shade)
from helpers.report import (LOGP_KEYS, algo_name, algo_order, entropy_area, experiment_runs, held_out, jsonable,
                            label, load_metrics, load_rollouts, mean, results_table, run_args, safe_name,
                            snapshot_measure, tallies_markdown, write_summary)
from helpers.runs import finite, series

F = importlib.import_module("01_formats")
R = importlib.import_module("02_rollouts")
G = importlib.import_module("03_grpo")


# --------------------------------------------------------------------------------------------- the check model
class PadTok:  # pack() only needs a pad id when there is no tokenizer
    pad_token_id = 0


def untie_unembedding(model, std=None):
    """Give the LM its own unembedding W (lm_head.weight) so that grad_W is the unembedding gradient alone.

    With tie_word_embeddings the lm_head shares the embedding matrix and grad_W would also collect the input-embedding
    gradient. std=None keeps the function (W = a copy of the embedding); otherwise W ~ N(0, std^2) (random models).
    """
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if std is not None:
        head.weight = torch.nn.Parameter(torch.randn(emb.shape, dtype=emb.dtype) * std)
    elif head.weight.data_ptr() == emb.data_ptr():
        head.weight = torch.nn.Parameter(emb.detach().clone())
    model.config.tie_word_embeddings = False  # so that a later tie_weights() does not tie them again
    return model


def exact_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """softmax(q k^T * scaling + mask) v, with grouped KV heads, in the input dtype throughout.

    Hugging Face's eager attention upcasts the softmax to float32 (and SDPA has no forward-mode AD), which would cap
    a float64 check at float32 accuracy: fine for gradients of the rounded function, not for finite differences.
    """
    n_rep = query.shape[1] // key.shape[1]  # query head h reads KV head h // n_rep
    k, v = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    w = query @ k.transpose(-1, -2) * scaling
    if attention_mask is not None:
        w = w + attention_mask[..., :k.shape[-2]]
    w = torch.softmax(w, dim=-1)
    return (w @ v).transpose(1, 2).contiguous(), w


def rms_norm_same_dtype(self, x):
    """RMSNorm x / sqrt(mean(x^2) + eps) * weight without the float32 round trip of the Hugging Face module."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def exact_float64(model):
    """Make a float64 model float64 all the way: own attention (registered as 'exact') and RMSNorm forwards."""
    from types import MethodType
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register("exact", exact_attention)
    AttentionMaskInterface.register("exact", eager_mask)  # additive float mask, as for eager attention
    model.set_attn_implementation("exact")
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):
            mod.forward = MethodType(rms_norm_same_dtype, mod)
    return model


def synthetic_group(n_ids, group_size, seed):
    """G prompt/response pairs of random token ids, with unequal prompt and response lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(group_size):
        p = torch.randint(1, n_ids, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(1, n_ids, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        out.append({"prompt_ids": p, "response_ids": r})
    return out


def build_case(model=None, tok=None, vocab_size=64, seed=0, lora_r=16, w_std=0.1, lora_b_std=0.02, group_size=6,
               dtype=torch.float64):
    """What every check works on: a Policy (02) over LM + LoRA with an untied, trainable W, and one synthetic group.

    model=None builds the random tiny Qwen2 of 01 (W ~ N(0, w_std^2), LoRA B ~ N(0, lora_b_std^2) so that lora_A
    has non-zero gradients). A given checkpoint keeps its function (W = its lm_head, LoRA B = 0).
    """
    random_init = model is None
    torch.manual_seed(seed)
    if random_init:
        model = untie_unembedding(F.tiny_model(vocab_size, seed), std=w_std)
    else:
        model = untie_unembedding(model)
    model = model.to(dtype)
    if dtype == torch.float64:
        model = exact_float64(model)
    else:
        model.set_attn_implementation("eager")  # forward-mode AD is not implemented for the fused SDPA kernels
    lm = F.add_lora(model, r=lora_r)
    base = lm.get_base_model()
    W = base.get_output_embeddings().weight
    assert W.data_ptr() != base.get_input_embeddings().weight.data_ptr(), "lm_head must be untied"
    assert base.get_output_embeddings().bias is None
    W.requires_grad_(True)  # theta = LoRA parameters + W
    if random_init:
        with torch.no_grad():
            for name, p in lm.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, lora_b_std)
    policy = R.Policy(lm).eval()
    params = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    w_name = next(n for n, p in params.items() if p is W)
    n_ids = len(tok) if tok is not None else W.shape[0]
    samples = synthetic_group(min(n_ids, W.shape[0]), group_size, seed)
    # group-normalised random rewards -> GRPO advantages, with 03's formula
    g = torch.Generator().manual_seed(seed + 1)
    trajs = [{"group": 0, "steps": [{"reward": float(r), "valid": True}]}
             for r in torch.randn(group_size, generator=g, dtype=torch.float64)]
    A = torch.tensor([t["steps"][0]["adv"] for t in G.grpo_advantages(trajs, level="traj")], dtype=dtype)
    return SimpleNamespace(policy=policy, lm=lm, tok=tok, W=W, w_name=w_name, params=params, samples=samples,
                           batch=F.pack(tok or PadTok, samples), A=A, dtype=dtype, V=W.shape[0],
                           rtol=1e-10 if dtype == torch.float64 else 1e-4)


def scores(case, params=None, batch=None):
    """Policy forward plus log q_k = log_softmax(W h_k) over the whole vocabulary at each response position.

    params (name -> tensor, a subset of case.params) evaluates the network at those values (torch.func style).
    Returns logp [B, L] of the taken tokens, entropy [B, L], h [B, L, d], log q [B, L, V], mask [B, L].
    """
    b = case.batch if batch is None else batch
    args = (b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
    if params is None:
        logp, ent, h = case.policy(*args, logit_states=True)
        W = case.W
    else:
        logp, ent, h = torch.func.functional_call(case.policy, params, args, {"logit_states": True})
        W = params[case.w_name]
    return logp, ent, h, torch.log_softmax(h @ W.T, dim=-1), b["mask"].to(case.dtype)


def check(name, lhs, rhs, rtol):
    """One residual row: max |lhs - rhs| against rtol * (1 + max |rhs|)."""
    lhs, rhs = torch.as_tensor(lhs), torch.as_tensor(rhs)
    res = (lhs - rhs).abs().max().item()
    tol = rtol * (1 + rhs.abs().max().item())
    return {"name": name, "residual": res, "tol": tol, "pass": res <= tol}


def trajectory_grads(case, l, names):
    """[G, P]: g_i = grad_theta l_i flattened over the parameters `names` (one backward per trajectory)."""
    plist = [case.params[n] for n in names]
    rows = []
    for i in range(len(l)):
        gs = torch.autograd.grad(l[i], plist, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(gs, plist)]))
    return torch.stack(rows)


# --------------------------------------------------------------------------------------------- lemma 3.2
def unembedding_gram(E, H):
    """sum_{k,k'} <E_ik, E_jk'> <H_ik, H_jk'> for E [G, L, V] (rows e - q, masked) and H [G, L, d] -> [G, G]."""
    n, L = E.shape[:2]
    EE = E.reshape(n * L, -1) @ E.reshape(n * L, -1).T  # <e_ik - q_ik, e_jk' - q_jk'>
    HH = H.reshape(n * L, -1) @ H.reshape(n * L, -1).T  # <h_ik, h_jk'>
    return (EE * HH).reshape(n, L, n, L).sum((1, 3))


def lemma_3_2(case):
    """Gradient inner products split into the unembedding (W) term and the backbone term."""
    logp, _, h, logq, m = scores(case)
    l = (logp * m).sum(1)  # trajectory log-likelihoods
    names = list(case.params)
    back = [n for n in names if n != case.w_name]
    g_all = trajectory_grads(case, l, names)
    g_W = trajectory_grads(case, l, [case.w_name])
    g_B = trajectory_grads(case, l, back)
    gram, gram_W, gram_B = g_all @ g_all.T, g_W @ g_W.T, g_B @ g_B.T
    # closed form of the W term
    q = logq.exp().detach()
    onehot = Fn.one_hot(case.batch["targets"], case.V).to(case.dtype)
    E = (onehot - q) * m[..., None]  # e_{y_k} - q_k at response positions, 0 at padding
    H = h.detach() * m[..., None]
    formula_W = unembedding_gram(E, H)
    # backbone: dl/dh_k = W^T (e_{y_k} - q_k) (row form E W), then g_i^B = J_i^T (E_i W) as a vector-Jacobian product
    dl_dh = torch.autograd.grad(l.sum(), h, retain_graph=True)[0]
    EW = E @ case.W.detach()
    plist = [case.params[n] for n in back]
    vjp_rows = []
    for i in range(len(l)):
        v = torch.zeros_like(h)
        v[i] = EW[i]
        gs = torch.autograd.grad(h, plist, grad_outputs=v, retain_graph=True, allow_unused=True)
        vjp_rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(gs, plist)]))
    g_B_vjp = torch.stack(vjp_rows)
    rows = [check("lemma 3.2 W term <g_i^W, g_j^W> = sum <e-q, e-q><h, h>", gram_W, formula_W, case.rtol),
            check("lemma 3.2 dl/dh_k = W^T (e_y - q)", dl_dh, EW, case.rtol),
            check("lemma 3.2 g^B = J^T W^T (e - q)", g_B, g_B_vjp, case.rtol),
            check("lemma 3.2 <g_i, g_j> = W term + backbone term", gram, formula_W + gram_B, case.rtol)]
    return {"rows": rows, "gram": gram.detach(), "gram_W": gram_W.detach(), "gram_B": gram_B.detach(),
            "formula_W": formula_W, "E": E, "q": q * m[..., None], "onehot": onehot * m[..., None], "H": H,
            "dl_dh": dl_dh.detach(), "W": case.W.detach(),
            "W_share": (gram_W.diagonal().sum() / gram.diagonal().sum()).item()}


# --------------------------------------------------------------------------------------------- lemma 3.3
def predicted_drift(gram, A, eta):
    """(eta / G) * sum_j A_j c_j with c_j = (1/G) sum_i <g_i, g_j>: the first-order mean change of l_i."""
    c = gram.mean(0)
    return eta / len(A) * (A * c).sum()


def lemma_3_3(case, etas=(1e-4, 1e-5)):
    """Actual vs first-order mean log-likelihood change after one GRPO gradient step, at several step sizes."""
    logp, _, _, _, m = scores(case)
    l = (logp * m).sum(1)
    names = list(case.params)
    g = trajectory_grads(case, l, names)
    gram = g @ g.T
    A = case.A
    step = (A[:, None] * g).mean(0)  # (1/G) sum_j A_j g_j  (= -grad L_RL)
    l0 = l.detach()
    saved = {n: p.detach().clone() for n, p in case.params.items()}
    actual, pred = [], []
    for eta in etas:
        with torch.no_grad():
            offset = 0
            for n in names:
                p = case.params[n]
                p.add_(eta * step[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            logp1, _, _, _, _ = scores(case)
            actual.append(((logp1 * m).sum(1) - l0).mean().item())
            for n, p in case.params.items():
                p.copy_(saved[n])
        pred.append(predicted_drift(gram, A, eta).item())
    rel = [abs(a - p) / abs(p) for a, p in zip(actual, pred)]
    order = math.log(rel[0] / rel[-1]) / math.log(etas[0] / etas[-1])  # 1 = the error is O(eta^2)
    row = {"name": "lemma 3.3 (1/G) sum_i dl_i = (eta/G) sum_j A_j c_j + O(eta^2)", "residual": rel[-1], "tol": 1e-2,
           "order": order, "pass": rel[-1] <= 1e-2 and abs(order - 1) <= 0.2,
           "uses_values": True, "detail": ", ".join(f"rel err {r:.1e} @ eta={e:.0e}" for r, e in zip(rel, etas)) +
                     f"; error order {order:.2f} (want 1 +- 0.2)"}
    return {"rows": [row], "etas": list(etas), "actual": actual, "predicted": pred, "rel_err": rel, "order": order,
            "gram": gram.detach(), "A": A, "c": gram.mean(0).detach()}


# --------------------------------------------------------------------------------------------- lemma 3.4
def entropy_of(logpi):
    return -(logpi.exp() * logpi).sum(-1)


def neg_cov(logpi, dlogpi):
    """-Cov_{y~pi}(log pi(y), dlog pi(y)/dt) along the last axis."""
    pi = logpi.exp()
    e_xy = (pi * logpi * dlogpi).sum(-1)
    return -(e_xy - (pi * logpi).sum(-1) * (pi * dlogpi).sum(-1))


def lemma_3_4_softmax(V=12, n=16, seed=0, fd_step=1e-6, rtol=1e-10):
    """(a) pi = softmax(z), random logits (several scales) and a random velocity dz/dt; dH/dt by JVP and by FD."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.3, 1.0, 3.0, 10.0], dtype=torch.float64).repeat_interleave(n // 4 or 1)[:, None]
    z = torch.randn(len(scale), V, generator=g, dtype=torch.float64) * scale
    dz = torch.randn(z.shape, generator=g, dtype=torch.float64)
    H = lambda x: entropy_of(torch.log_softmax(x, -1))  # noqa: E731
    _, dH = torch.func.jvp(H, (z,), (dz,))
    logpi, dlogpi = torch.func.jvp(lambda x: torch.log_softmax(x, -1), (z,), (dz,))
    rhs = neg_cov(logpi, dlogpi)
    dH_fd = (H(z + fd_step * dz) - H(z - fd_step * dz)) / (2 * fd_step)
    rows = [check("lemma 3.4a softmax: dH/dt (jvp) = -Cov(log pi, dlog pi/dt)", dH, rhs, rtol),
            check("lemma 3.4a softmax: dH/dt (finite diff) = -Cov", dH_fd, rhs, 1e-6)]
    return {"rows": rows, "dH": dH, "dH_fd": dH_fd, "neg_cov": rhs, "logpi": logpi, "dlogpi": dlogpi}


def grpo_velocity(case):
    """dtheta/dt = -grad L_GRPO: 03's token loss at ratio 1 (old = current, ref = current), token-mean."""
    logp, _, _, _, m = scores(case)
    adv = case.A[:, None].expand_as(m)
    loss_tok, _, _ = G.token_losses(logp, logp.detach(), logp.detach(), adv, 0.2, 0.01)
    loss = (loss_tok * m).sum() / m.sum()
    names = list(case.params)
    gs = torch.autograd.grad(loss, [case.params[n] for n in names], allow_unused=True)
    return {n: (torch.zeros_like(case.params[n]) if g is None else -g).detach() for n, g in zip(names, gs)}


def lemma_3_4_model(case, fd_step=1e-6):
    """(b) Per response token of the live model, over the whole vocabulary, under dtheta/dt = -grad L_GRPO."""
    u = grpo_velocity(case)
    theta = {n: p.detach() for n, p in case.params.items()}

    def f(ps):
        _, ent, _, logq, _ = scores(case, ps)
        return ent, logq

    (ent, logq), (dent, dlogq) = torch.func.jvp(f, (theta,), (u,))
    m = case.batch["mask"].bool()
    rhs = neg_cov(logq, dlogq)[m]
    plus = f({n: theta[n] + fd_step * u[n] for n in theta})[0]
    minus = f({n: theta[n] - fd_step * u[n] for n in theta})[0]
    dent_fd = ((plus - minus) / (2 * fd_step))[m]
    rows = [check(f"lemma 3.4b live model ({int(m.sum())} tokens): dH/dt (jvp) = -Cov over vocab", dent[m], rhs,
                  case.rtol),
            dict(check("lemma 3.4b live model: dH/dt (finite diff) = -Cov over vocab", dent_fd.detach(), rhs, 1e-6),
                 uses_values=True)]
    return {"rows": rows, "dH": dent[m].detach(), "dH_fd": dent_fd.detach(), "neg_cov": rhs.detach(),
            "logq": logq[m].detach(), "dlogq": dlogq[m].detach(),
            "rising_share": (rhs > 0).double().mean().item()}


# --------------------------------------------------------------------------------------------- EMPG proposition 1
def expected_sq_grad_norm(z, chunk_elems=2 ** 22):
    """E_{a~pi} ||grad_z log pi(a)||^2 by autograd: one vector-Jacobian product per vocabulary entry a (vmapped)."""
    logpi, vjp_fn = torch.func.vjp(lambda x: torch.log_softmax(x, -1), z)
    pi = logpi.exp().detach()
    V = z.shape[-1]
    chunk = max(1, chunk_elems // z.numel())
    out = torch.zeros(z.shape[:-1], dtype=z.dtype)
    eye = torch.eye(V, dtype=z.dtype)
    for a0 in range(0, V, chunk):
        basis = eye[a0:a0 + chunk].reshape(-1, *([1] * (z.dim() - 1)), V).expand(-1, *z.shape)  # [c, ..., V]
        rows = torch.func.vmap(vjp_fn)(basis)[0]  # grad_z log pi(a) for a in the chunk
        out += (pi[..., a0:a0 + chunk].movedim(-1, 0) * (rows ** 2).sum(-1)).sum(0)
    return out


def empg_prop1(z, label, rtol):
    pi = torch.softmax(z, -1)
    lhs = expected_sq_grad_norm(z)
    rhs = 1 - (pi ** 2).sum(-1)
    H2 = -torch.log((pi ** 2).sum(-1))  # Renyi-2 entropy
    rows = [check(f"EMPG prop 1 {label}: E||grad_z log pi||^2 = 1 - sum pi^2", lhs, rhs, rtol),
            check(f"EMPG prop 1 {label}: 1 - sum pi^2 = 1 - exp(-H_2)", rhs, 1 - torch.exp(-H2), rtol)]
    return {"rows": rows, "lhs": lhs, "rhs": rhs, "H2": H2, "H": entropy_of(torch.log_softmax(z, -1))}


def empg_prop1_logits(V=16, n=8, temps=(0.25, 0.5, 1.0, 2.0, 4.0), seed=0, rtol=1e-10):
    """Random logits at several temperatures: z / T."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    zt = torch.stack([z / t for t in temps])  # [T, n, V]
    out = empg_prop1(zt, f"random logits T={','.join(map(str, temps))}", rtol)
    out["temps"] = list(temps)
    return out


def empg_prop1_model(case, max_positions=None):
    """The live model's next-token distributions at the response positions of the synthetic group."""
    with torch.no_grad():
        _, _, h, _, _ = scores(case)
        z = (h @ case.W.T)[case.batch["mask"].bool()]
    cap = max_positions or (64 if case.V <= 4096 else 2)  # V^2 work per position
    return empg_prop1(z[:cap], f"live model ({min(cap, len(z))} positions)", case.rtol)


# --------------------------------------------------------------------------------------------- open question
SITUATIONS = [  # made-up states for a checkpoint with a tokenizer (env, task, observation, admissible actions)
    ("alfworld", "put a clean mug in coffeemachine.", "You are in the middle of a room. You see a countertop 1, "
     "a sinkbasin 1 and a coffeemachine 1.", ["go to countertop 1", "go to sinkbasin 1", "look"]),
    ("alfworld", "heat some egg and put it in garbagecan.", "You arrive at fridge 1. The fridge 1 is closed.",
     ["open fridge 1", "go to microwave 1", "inventory"]),
    ("webshop", "i need a pair of red running shoes under 50 dollars", "WebShop [SEP] Instruction: [SEP] i need a "
     "pair of red running shoes under 50 dollars [SEP] Search", ["search[<your query>]"]),
    ("webshop", "find a 12 pack of sugar free soda", "Back to Search [SEP] Page 1 [SEP] B01 [SEP] Zero Sugar Cola "
     "12 Pack [SEP] $9.99 [SEP] B02 [SEP] Lemon Soda [SEP] $4.50", ["click[b01]", "click[b02]", "click[next >]"]),
]


def sample_responses(case, n, max_new_tokens, temperature, seed):
    """n prompt/response pairs sampled from the model (random prompt ids when there is no tokenizer)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 7)
    out = []
    for i in range(n):
        if case.tok is None:
            p = torch.randint(1, case.V, (int(torch.randint(3, 16, (1,), generator=g)),), generator=g)
            ids = case.lm.generate(input_ids=p[None], attention_mask=torch.ones_like(p)[None], do_sample=True,
                                   temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                   min_new_tokens=2, pad_token_id=0, eos_token_id=None)
            out.append({"prompt_ids": p.tolist(), "response_ids": ids[0, len(p):].tolist()})
        else:
            env, task, obs, acts = SITUATIONS[i % len(SITUATIONS)]
            prompt = F.chat(case.tok, F.build_prompt(env, task, obs, acts, [], 2))
            resp = F.generate(case.lm, case.tok, [prompt], temperature, max_new_tokens)[0]
            out.append({"prompt_ids": case.tok(prompt, add_special_tokens=False)["input_ids"], "response_ids": resp})
    return [s for s in out if s["response_ids"]]


def ranks(x):
    r = torch.empty_like(x)
    r[x.argsort()] = torch.arange(len(x), dtype=x.dtype)
    return r


def pearson(x, y):
    return torch.corrcoef(torch.stack([x, y]))[0, 1].item()


def grad_norm_vs_entropy(case, samples=None, n=16, max_new_tokens=12, temperature=1.0, seed=0):
    """Per step: gradient norms in parameter space vs the step's mean token entropy (and its logit-space twin).

    sq_norm       ||grad_theta log pi(response)||^2      (the whole step's log-likelihood)
    sq_norm_tok   ||grad_theta (1/L) log pi(response)||^2 (token-mean, as in the loss)
    per_token     (1/L) sum_k ||grad_theta log pi(y_k)||^2  (Prop. 1's quantity, lifted to parameters)
    W / backbone parts of per_token, and the logit-space value (1/L) sum_k (1 - sum_v q_k(v)^2).
    """
    samples = samples or sample_responses(case, n, max_new_tokens, temperature, seed)
    names = list(case.params)
    rec = {k: [] for k in ("entropy", "sq_norm", "sq_norm_tok", "per_token", "per_token_W", "per_token_B",
                           "logit_space")}
    order = [case.w_name] + [x for x in names if x != case.w_name]
    w_cols = slice(0, case.W.numel())
    for s in samples:
        b = F.pack(case.tok or PadTok, [s])
        logp, ent, _, logq, m = scores(case, batch=b)
        L = int(m.sum())
        gk = trajectory_grads(case, logp[0, :L], order)  # [L, P]: grad of each token's log-prob
        gsum = gk.sum(0)
        sq = (gk ** 2).sum(1)
        sqW = (gk[:, w_cols] ** 2).sum(1)
        rec["entropy"].append(ent[0, :L].mean().item())
        rec["sq_norm"].append((gsum ** 2).sum().item())
        rec["sq_norm_tok"].append((gsum ** 2).sum().item() / L ** 2)
        rec["per_token"].append(sq.mean().item())
        rec["per_token_W"].append(sqW.mean().item())
        rec["per_token_B"].append((sq - sqW).mean().item())
        rec["logit_space"].append((1 - (logq[0, :L].exp() ** 2).sum(-1)).mean().item())
    ent = torch.tensor(rec["entropy"], dtype=torch.float64)
    corr = {}
    for k in rec:
        if k == "entropy":
            continue
        x = torch.tensor(rec[k], dtype=torch.float64)
        corr[k] = {"pearson": pearson(x, ent), "spearman": pearson(ranks(x), ranks(ent))}
    return {"n_steps": len(samples), "values": rec, "corr": corr,
            "response_tokens": sum(len(s["response_ids"]) for s in samples) / max(len(samples), 1)}


# --------------------------------------------------------------------------------------------- running the checks
def verdict(row):
    return {True: "PASS", False: "FAIL", None: "(not scored below float64)"}[row["pass"]]


def run_lemmas(case, args, label):
    results, t = {}, time.time()
    steps = [("lemma_3_2", lambda: lemma_3_2(case)),
             ("lemma_3_3", lambda: lemma_3_3(case, tuple(float(e) for e in args.etas.split(",")))),
             ("lemma_3_4a", lambda: lemma_3_4_softmax(seed=args.seed, fd_step=args.fd_step)),
             ("lemma_3_4b", lambda: lemma_3_4_model(case, args.fd_step)),
             ("empg_prop1_logits", lambda: empg_prop1_logits(seed=args.seed)),
             ("empg_prop1_model", lambda: empg_prop1_model(case)),
             ("grad_norm_vs_entropy", lambda: grad_norm_vs_entropy(case, n=args.steps, seed=args.seed,
                                                                   max_new_tokens=args.max_new_tokens))]
    print(f"== {label}: V={case.V}, {sum(p.numel() for p in case.params.values()):,} trainable parameters "
          f"(LoRA + untied W), {case.dtype}")
    for key, fn in steps:
        t0 = time.time()
        out = fn()
        out["seconds"] = round(time.time() - t0, 2)
        for row in out.get("rows", []):
            if row.get("uses_values") and case.dtype != torch.float64:
                row["pass"] = None  # differences of function values: float32 roundoff swamps them
            if "detail" in row:
                print(f"{row['name']}: {row['detail']} {verdict(row)}")
            else:
                print(f"{row['name']}: max |lhs - rhs| = {row['residual']:.1e} (tol {row['tol']:.0e}) {verdict(row)}")
        if key == "lemma_3_2":
            print(f"  W term share of sum_i ||g_i||^2: {out['W_share']:.3f}")
        if key == "lemma_3_4b":
            print(f"  tokens whose entropy rises under the GRPO step (-Cov > 0): {out['rising_share']:.2f}")
        if key == "grad_norm_vs_entropy":
            print(f"open question ({out['n_steps']} steps, {out['response_tokens']:.1f} tokens each): "
                  "corr with step entropy (pearson / spearman)")
            for k, c in out["corr"].items():
                print(f"  {k:12s} {c['pearson']:+.3f} / {c['spearman']:+.3f}")
        print(f"  [{key}: {out['seconds']:.2f}s]")
        results[key] = out
    results["seconds"] = round(time.time() - t, 2)
    return results


def all_pass(results):
    return all(row["pass"] is not False for r in results.values() if isinstance(r, dict) for row in r.get("rows", []))


# --------------------------------------------------------------------------------------------- log analysis + plots
def smooth(x, window):
    """Centred moving average; the window shrinks at the ends (no lag, so peaks stay where they are)."""
    h = max(int(window), 1) // 2
    return [sum(x[max(0, t - h):t + h + 1]) / len(x[max(0, t - h):t + h + 1]) for t in range(len(x))]


def label_phases(entropy, window=5, rise=0.2, rise_abs=0.0):
    """Descent / eruption / subsidence labels of a per-update entropy curve, and the eruptions (start, peak, end).

    On s = smooth(entropy, window), with threshold thr = rise_abs if > 0 else rise * (max s - min s), walk forward:
      descent:    keep lo = the running minimum since the last phase change; once s_t - s_lo > thr an eruption
                  starts at lo (the trough), peak = t.
      eruption:   peak follows new maxima; once s_t < s_peak - thr the peak is confirmed -> subsidence.
      subsidence: ends (end = t, back to descent) when s_t <= s_start, the level the eruption rose from; a new rise
                  by more than thr above the running minimum since the peak starts the next eruption there instead
                  (end = that trough - 1). An eruption still open at the last update ends there.
    Labels: start..peak eruption, peak+1..end subsidence, everything else descent. Indices, not update numbers.
    """
    s = smooth(list(entropy), window)
    n = len(s)
    thr = rise_abs if rise_abs > 0 else rise * (max(s) - min(s)) if n else 0.0
    intervals, state, lo, start, peak = [], "descent", 0, 0, 0
    for t in range(n):
        if state == "eruption":
            if s[t] >= s[peak]:
                peak = t
            elif s[peak] - s[t] > thr:
                state, lo = "subsidence", t
            continue
        if state == "subsidence" and s[t] <= s[start]:
            intervals.append((start, peak, t))
            state, lo = "descent", t
        elif s[t] < s[lo]:
            lo = t
        elif thr > 0 and s[t] - s[lo] > thr:
            if state == "subsidence":
                intervals.append((start, peak, lo - 1))
            state, start, peak = "eruption", lo, t
    if state != "descent":
        intervals.append((start, peak, n - 1))
    labels = ["descent"] * n
    for a, p, e in intervals:
        labels[a:p + 1] = ["eruption"] * (p + 1 - a)
        labels[p + 1:e + 1] = ["subsidence"] * (e - p)
    return {"smoothed": s, "labels": labels, "intervals": intervals, "threshold": thr}


def noise_threshold(control_entropy, window, k):
    """The eruption threshold from a no-learning control (--lr 0, same seeds): the control's update-to-update sd
    sd_c = sd(H_u - H_{u-1}) / sqrt(2) (what task sampling alone moves the batch entropy by; slow drift cancels),
    and thr = k * sd_c * sqrt(2 / w), k times the sd of a difference of two w-update means of such noise. On iid
    noise, k = 4 with w = 5 labels 0.12 false eruptions per 150 updates (200 simulated series; 11.5% have one)."""
    d = [b - a for a, b in zip(control_entropy, control_entropy[1:])]
    if len(d) < 2:
        raise SystemExit("error: the --control run needs at least 3 logged updates with an entropy")
    mu = sum(d) / len(d)
    sd = math.sqrt(sum((x - mu) ** 2 for x in d) / (len(d) - 1)) / math.sqrt(2)
    return {"sd": sd, "threshold": k * sd * math.sqrt(2 / window), "k": k, "window": window,
            "updates": len(control_entropy)}


def eruption_sweep(entropy, window, control_entropy=None, ks=(2, 3, 4, 6)):
    """C1 over a range of thresholds: for k in ks, thr = k sd sqrt(2 / w) with sd from the no-learning control
    (when given) and from the run's own update-to-update noise; per threshold the eruptions, how many subsided (the
    peak was confirmed: the curve fell back by more than thr) and how many came back to the level they rose from.
    {source: {k: {"threshold", "eruptions", "subsided", "returned"}}}."""
    out = {}
    for source, series_ in (("control", control_entropy), ("own", entropy)):
        if not series_ or len(series_) < 3:
            continue
        out[source] = {}
        for k in ks:
            thr = noise_threshold(series_, window, k)["threshold"]
            ph = label_phases(entropy, window, rise_abs=thr)
            s, iv = ph["smoothed"], ph["intervals"]
            fall = [(s[p] - min(s[p:e + 1]), min(s[p:e + 1]) - s[a]) for a, p, e in iv]  # how far down, vs start
            out[source][k] = {"threshold": thr, "eruptions": len(iv), "subsided": sum(d > thr for d, _ in fall),
                              "returned": sum(d > thr and r <= 0 for d, r in fall)}
    return out


def fisher_ratio(X, won):
    """||mu_c - mu_w||^2 / (tr Sigma_c + tr Sigma_w) for rows X [n, d] split by won; NaN if a class has < 2 rows."""
    X, won = torch.as_tensor(X, dtype=torch.float64), torch.as_tensor(won, dtype=torch.bool)
    c, w = X[won], X[~won]
    if len(c) < 2 or len(w) < 2:
        return float("nan")
    spread = lambda Z: ((Z - Z.mean(0)) ** 2).sum(1).mean()  # noqa: E731  tr of the (1/n) covariance
    return (((c.mean(0) - w.mean(0)) ** 2).sum() / (spread(c) + spread(w)).clamp(min=1e-12)).item()


def fisher_null(X, won, perms=200, seed=0):
    """C2's null: the Fisher ratio with the correct/wrong labels shuffled over the same rows (same counts), `perms`
    times. With few rows in a class the ratio is large by chance (14 vs 2 random rows give ~0.3), so a ratio means
    overlap or separation only against this. Returns the observed ratio, the null's median and 95th percentile, and
    p = (1 + #{null >= observed}) / (1 + perms) (small: more separated than chance); None if a class has < 2 rows."""
    ratio = fisher_ratio(X, won)
    if not math.isfinite(ratio):
        return None
    rng = random.Random(seed)
    won = list(won)
    null = []
    for _ in range(perms):
        rng.shuffle(won)
        null.append(fisher_ratio(X, won))
    null.sort()
    return {"ratio": ratio, "null_median": null[perms // 2], "null_q95": null[int(0.95 * (perms - 1))],
            "p": (1 + sum(v >= ratio for v in null)) / (1 + perms), "perms": perms,
            "n_correct": int(sum(won)), "n_wrong": len(won) - int(sum(won))}


def trajectory_hidden(ep):
    """The episode's mean hidden state: hidden_mean averaged over its steps (each step weighs the same)."""
    hs = [s["hidden_mean"] for s in ep["steps"] if s.get("hidden_mean")]
    return torch.tensor(hs, dtype=torch.float64).mean(0) if hs else None


def hidden_states(rollouts):
    """{update: (X [n, d], won [n])} over the episodes that have hidden states."""
    out = {}
    for u, eps in sorted(rollouts.items()):
        pairs = [(h, bool(ep["won"])) for ep in eps for h in [trajectory_hidden(ep)] if h is not None]
        if pairs:
            out[u] = (torch.stack([h for h, _ in pairs]), [w for _, w in pairs])
    return out


BACK = ("click[< prev]", "click[back to search]")


def webshop_outcomes(rollouts, run_args=None):
    """Replay saved WebShop episodes (the env is deterministic) and count why each ended (WebShopEnv.outcome), and
    the share of steps that navigate back: the move that recovers from a wrong item, so a policy that never makes it
    cannot find a better purchase by sampling. run_args: the run's args.json (its --data / --split / --goals)."""
    a = run_args or {}
    real = {"data": a["data"], "split": a.get("split", "train"), "goals": a.get("goals", "synthetic")} if a.get("data") else {}
    env = F.make_env("webshop", max_steps=10 ** 6, **real)  # the saved steps end each episode where the run's cap did
    counts, back, steps = {}, 0, 0
    for eps in rollouts.values():
        for ep in eps:
            env.reset(ep["seed"])
            for s in ep["steps"]:
                action = s["action"] if s["valid"] else None
                back += action is not None and " ".join(action.lower().split()) in BACK
                steps += 1
                env.step(action)
            end = env.outcome()
            counts[end] = counts.get(end, 0) + 1
    return {"episodes": sum(counts.values()), "back_rate": back / max(steps, 1),
            "outcomes": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


def by_task_type(rollouts):
    """{task type: [won, played]} over the saved episodes that carry a task type (ALFWorld's six)."""
    out = {}
    for ep in (ep for eps in rollouts.values() for ep in eps if ep.get("task_type")):
        won_played = out.setdefault(ep["task_type"], [0, 0])
        won_played[0] += bool(ep["won"])
        won_played[1] += 1
    return dict(sorted(out.items()))


def analyse_run(run, args):
    rows = load_metrics(run)
    ups, ent = series(rows, "entropy")
    ph = label_phases(ent, args.smooth, args.rise, args.rise_abs)
    rollouts = load_rollouts(run)
    hid = hidden_states(rollouts)
    name = os.path.basename(os.path.normpath(run))
    ra = run_args(run)
    outcomes = webshop_outcomes(rollouts, ra) if rollouts and ra.get("env") == "webshop" else None
    sep_file = os.path.join(run, "separation.json")  # rollouts (8 MB a run) are not committed, this file is
    null_file = os.path.join(run, "separation-null.json")
    separation, null = {}, {}
    if hid:
        separation = {u: fisher_ratio(X, w) for u, (X, w) in hid.items()}
        null = {u: fisher_null(X, w, seed=args.seed) for u, (X, w) in hid.items()}
        with open(sep_file, "w") as f:
            json.dump({str(u): v for u, v in separation.items()}, f)
        with open(null_file, "w") as f:
            json.dump({str(u): v for u, v in null.items()}, f)
    else:
        if os.path.exists(sep_file):
            with open(sep_file) as f:
                separation = {int(u): v for u, v in json.load(f).items()}
        if os.path.exists(null_file):
            with open(null_file) as f:
                null = {int(u): v for u, v in json.load(f).items()}
    return {"run": run, "name": name, "rows": rows, "updates": ups, "entropy": ent, "phases": ph,
            "eruptions": [tuple(ups[i] for i in iv) for iv in ph["intervals"]], "hidden": hid,
            "separation": separation, "separation_null": null, "outcomes": outcomes,
            "by_type": by_task_type(rollouts)}


def run_stats(info, window):
    """The numbers of summary.md: all read off the logs (NaN where a log has nothing)."""
    rows, lab = info["rows"], dict(zip(info["updates"], info["phases"]["labels"]))
    inside = {u for a, _, e in info["eruptions"] for u in range(a, e + 1)}
    keys = ("entropy", "duplication", "hallucination", "valid_ratio", "success")
    per_phase = {p: {"updates": sum(v == p for v in lab.values()),
                     **{k: mean([r.get(k) for r in rows if lab.get(r["update"]) == p]) for k in keys}}
                 for p in ("descent", "eruption", "subsidence")}
    edge = {}
    for k in ("success", "valid_ratio", "val_success"):
        _, v = series(rows, k)
        w = 1 if k == "val_success" else window
        edge[k] = (mean(v[:w]), mean(v[-w:])) if v else (float("nan"),) * 2
    io = {k: (mean([r.get(k) for r in rows if r["update"] in inside]),
              mean([r.get(k) for r in rows if r["update"] not in inside])) for k in ("duplication", "hallucination")}
    sep = [(u, v) for u, v in info["separation"].items() if finite(v)]
    return {"updates": len(rows), "eruptions": info["eruptions"], "threshold": info["phases"]["threshold"],
            "per_phase": per_phase, "start_end": edge, "inside_outside": io,
            "separation_first_last": (sep[0], sep[-1]) if sep else None, "rollout_updates": sorted(info["hidden"]),
            "separation_null": {u: v for u, v in info.get("separation_null", {}).items() if v},
            "outcomes": info["outcomes"], "by_type": info.get("by_type") or {}}


# gradient interference (Lemma 3.3 per sample)
def interference(policy, tok, samples):
    """A_j and c_j = (1/G) sum_i <g_i, g_j> for G samples (trajectory steps with prompt_ids, response_ids, adv).

    g_j = grad of the step's log-likelihood l_j = sum_k log pi(y_jk) over the trainable LoRA parameters (a SEAL head,
    which l does not depend on, is left out). Returns A, c, the Gram matrix and l (float64 on the CPU).
    """
    params = {n: p for n, p in policy.lm.named_parameters() if p.requires_grad}
    device = next(policy.parameters()).device
    b = F.pack(tok, samples, device)
    logp, _, _ = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
    l = (logp * b["mask"]).sum(1)
    g = trajectory_grads(SimpleNamespace(params=params), l, list(params)).double().cpu()
    gram = g @ g.T
    A = torch.tensor([float(s["adv"]) for s in samples], dtype=torch.float64)
    return {"A": A, "c": gram.mean(0), "gram": gram, "l": l.detach().double().cpu()}


def checkpoints(run):
    """Paths of the *.pt files under run/ckpt* (03 keeps only ckpt/state.pt; copies of it may sit next to it)."""
    return sorted(os.path.join(root, f) for folder in sorted(os.listdir(run)) if folder.startswith("ckpt")
                  for root, _, files in os.walk(os.path.join(run, folder)) for f in files if f.endswith(".pt"))


def where(info, u):
    """Position of update u relative to the run's eruptions, in words."""
    for k, (a, p, e) in enumerate(info["eruptions"], 1):
        if a <= u <= p:
            return f"rising part of eruption {k}"
        if p < u <= e:
            return f"subsidence of eruption {k}"
    done, n = sum(e < u for _, _, e in info["eruptions"]), len(info["eruptions"])
    if not n:
        return "no eruption"
    return "before eruption 1" if not done else f"after eruption {done}" + (f", before {done + 1}" if done < n else "")


def snapshot_policy(run):
    """The run's base with a LoRA of its rank (zero adapter), its tokenizer and its parameters by name."""
    ra = run_args(run)
    lm, tok = F.load_base(ra.get("model", "tiny"))
    policy = R.Policy(F.add_lora(lm, r=ra.get("lora_r", 16))).eval()
    return policy, tok, dict(policy.named_parameters())


def load_snapshot(named, path):
    """Copy a checkpoint's LoRA weights into `named`; its update, or None for a file that is not a checkpoint."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not (isinstance(state, dict) and "params" in state):
        return None
    with torch.no_grad():
        for k, v in state["params"].items():
            if k in named:  # a SEAL head (seal_head.*) is not part of the log-likelihood
                named[k].copy_(v)
    return int(state.get("update", -1))


def run_interference(info, args):
    """c_j vs A_j at each checkpoint of a run, on the saved rollout batch nearest to the checkpoint's policy."""
    run, cks = info["run"], checkpoints(info["run"])
    rollouts = load_rollouts(run)
    out = {"points": [], "note": ""}
    if not cks or not rollouts:
        out["note"] = f"not computed: {'no checkpoint' if not cks else 'no rollout records'} in {run}"
        return out
    policy, tok, named = snapshot_policy(run)
    done = set()
    for path in cks:
        u = load_snapshot(named, path)
        if u is None or u in done:  # ckpt/state.pt repeats the last snapshot's update: measure it once
            continue
        done.add(u)
        r = min(rollouts, key=lambda x: (abs(x - (u + 1)), -x))  # rollouts of update u+1 were sampled by ckpt u
        steps = [s for ep in rollouts[r] for s in ep["steps"] if "adv" in s and s.get("response_ids")]
        steps = random.Random(args.seed).sample(steps, min(args.interference_samples, len(steps)))
        if not steps:
            continue
        samples = [{"prompt_ids": tok(s["prompt"], add_special_tokens=False)["input_ids"],
                    "response_ids": s["response_ids"], "adv": s["adv"]} for s in steps]
        res = interference(policy, tok, samples)
        out["points"].append({"update": u, "rollout_update": r, "where": where(info, u), "A": res["A"].tolist(),
                              "c": res["c"].tolist(), "sum_Ac_over_G": (res["A"] * res["c"]).mean().item()})
    out["points"].sort(key=lambda p: p["update"])
    ups = [p["update"] for p in out["points"]]
    both = any(any(x <= a for x in ups) and any(x >= p for x in ups) for a, p, _ in info["eruptions"])
    out["both_sides"] = both
    if not both:
        out["note"] = (f"no checkpoints on both sides of an eruption: only at update(s) {ups or 'none usable'} "
                       f"({', '.join(p['where'] for p in out['points'])}); the plot shows what exists")
    return out


def rescore(info, args):
    """C4 without the tautology: the mean token log-prob of one fixed set of sampled steps (up to
    --rescore_samples, drawn from all saved rollout batches: valid steps, steps of won and of lost episodes) under
    the base (the zero adapter, update 0) and every snapshot ckpt/state-uNNNNN.pt. metrics.jsonl's logp_valid
    scores each update's own samples, whose mean log-prob is minus their entropy by construction; here the samples
    stay fixed, so a fall means the policy moved away from steps it once took. The sampled steps include those of
    eruption policies, which a policy moving towards them scores higher; logp_expert scores valid steps from outside
    the run as well (expert_steps)."""
    run = info["run"]
    cks = [p for p in checkpoints(run) if re.search(r"state-u\d+\.pt$", p)]
    rollouts = load_rollouts(run)
    if not cks or not rollouts:
        return {"points": [], "note": f"not computed: no {'snapshot' if not cks else 'rollout record'} in {run}"}
    steps = [(bool(ep["won"]), s) for u in sorted(rollouts) for ep in rollouts[u] for s in ep["steps"]
             if s.get("response_ids")]
    steps = random.Random(args.seed).sample(steps, min(args.rescore_samples, len(steps)))
    policy, tok, named = snapshot_policy(run)
    samples = [{"prompt_ids": tok(s["prompt"], add_special_tokens=False)["input_ids"], "response_ids": s["response_ids"]}
               for _, s in steps]
    demos = expert_steps(run, rollouts, tok, args)
    ent = dict(zip(info["updates"], info["phases"]["smoothed"]))
    points = []
    for path in [None] + cks:
        u = load_snapshot(named, path) if path else 0
        R.score(policy, tok, samples + demos)
        group = lambda keep: mean([x for (won, s), x_s in zip(steps, samples) if keep(won, s)  # noqa: E731
                                   for x in x_s["old_logp"]])
        points.append({"update": u, "logp_valid": group(lambda w, s: s["valid"]), "logp_correct": group(lambda w, s: w),
                       "logp_wrong": group(lambda w, s: not w), "logp_expert": mean([x for d in demos for x in d["old_logp"]]),
                       "entropy_smoothed": ent.get(u), "where": where(info, u)})
    return {"rollout_updates": sorted(rollouts), "steps": len(steps), "won_steps": sum(w for w, _ in steps),
            "expert_steps": len(demos), "points": points, "note": ""}


def expert_steps(run, rollouts, tok, args):
    """Valid trajectories that do not come from the run: the env expert's demonstration steps on the tasks the run
    played (the seeds of its saved episodes; up to --rescore_samples steps), chat-templated as 01 mid-trains on them."""
    ra = run_args(run)
    env = ra.get("env", "alfworld")
    seeds = sorted({ep["seed"] for u in rollouts for ep in rollouts[u] if "seed" in ep})
    F.use_data(env, ra.get("data", ""), ra.get("split", "train"), ra.get("goals", "synthetic"),
               single_turn=ra.get("single_turn", False))
    demos = F.demo_pairs(tok, F.expert_demos(env, seeds, ra.get("history_length", 2), ra.get("max_steps") or None))
    return random.Random(args.seed).sample(demos, min(args.rescore_samples, len(demos)))


def analyse_logs(args):
    """The log-analysis mode: plots (a)-(f) and summary.md for the runs in --runs."""
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    noise, control = None, None
    if args.control:  # the rule is fixed by the control before any trained run is looked at
        control = series(load_metrics(args.control), "entropy")[1]
        noise = noise_threshold(control, args.smooth, args.rise_sd)
        noise["run"] = args.control
        args.rise_abs = noise["threshold"]
    infos = [analyse_run(r, args) for r in runs]
    seen = {}
    for info in infos:  # two folders with the same basename get a suffix
        seen[info["name"]] = seen.get(info["name"], 0) + 1
        if seen[info["name"]] > 1:
            info["name"] += f"-{seen[info['name']]}"
    os.makedirs(args.out_dir, exist_ok=True)
    out = lambda f: os.path.join(args.out_dir, f)  # noqa: E731
    pngs = {"all": [plot_entropy(infos, out("entropy.png")),
                    plot_overlay(infos, ["valid_ratio", "success", "val_success"], out("success.png")),
                    plot_rows(infos, ["logp_correct", "logp_wrong", "logp_valid"], out("logp.png"), "mean token logp"),
                    plot_rows(infos, ["duplication", "hallucination"], out("degenerate.png"), "rate")]}
    if any(finite(v) for info in infos for v in info["separation"].values()):
        pngs["all"].append(plot_separation(infos, out("separation.png")))
    stats = {}
    for info in infos:
        st = stats[info["name"]] = run_stats(info, args.smooth)
        st["eruption_sweep"] = eruption_sweep(info["entropy"], args.smooth, control)
        pngs[info["name"]] = []
        if info["hidden"]:
            pngs[info["name"]].append(plot_hidden(info, out(f"hidden-{safe_name(info['name'])}.png")))
        res = snapshot_measure(info, args, "interference", run_interference)
        if res is not None:
            st["interference"] = res
            if res["points"]:
                pngs[info["name"]].append(plot_interference(res, out(f"interference-{safe_name(info['name'])}.png")))
        res = snapshot_measure(info, args, "rescore", rescore)
        if res is not None:
            st["rescore"] = res
            if res["points"]:
                png = out(f"rescore-{safe_name(info['name'])}.png")
                pngs[info["name"]].append(plot_rescore(info, res, png, LOGP_KEYS))
        print(f"{info['name']}: {st['updates']} updates, {len(st['eruptions'])} eruption(s) {st['eruptions']}")
    path = write_summary(infos, stats, pngs, args, out("summary.md"), BACK, noise)
    print(f"wrote {path} and {sum(len(v) for v in pngs.values())} plots")
    return {"stats": stats, "pngs": pngs, "summary": path, "noise": noise, "infos": infos,
            "phases": {i["name"]: {"updates": i["updates"], "labels": i["phases"]["labels"]} for i in infos}}


def snapshot_tallies(stats, threshold):
    """C3 and C4 over every run with snapshot measurements (rescore.json, interference.json).
    C4: each pair of consecutive re-scored snapshots is an interval whose smoothed entropy rose (fell) by more than
    the eruption threshold, or stayed within it; count in how many the fixed valid / correct / wrong steps' mean
    log-prob fell and rose (sign test of fell vs rose against 1/2). C3: per run, the mean of (1/G) sum_j A_j c_j at
    snapshots before or in the rise of an eruption against those while one subsides or after one ("for" when the
    first is the more negative; "after k, before k+1" counts as before), and at how many snapshots the
    negative-advantage steps have the larger mean c_j."""
    c4, changes = {}, {}
    for st in stats.values():
        pts = [p for p in (st.get("rescore") or {}).get("points", []) if p.get("entropy_smoothed") is not None]
        for a, b in zip(pts, pts[1:]):
            d = b["entropy_smoothed"] - a["entropy_smoothed"]
            kind = "rose" if d > threshold else "fell" if d < -threshold else "within the threshold"
            for k in LOGP_KEYS:
                if a.get(k) is not None and b.get(k) is not None:  # logp_expert: rescore.json of today's 06 only
                    c4.setdefault(kind, {}).setdefault(k, [0, 0])[b[k] > a[k]] += 1
                    changes.setdefault(k, []).append((d, b[k] - a[k]))
    c3 = []
    late = lambda w: ("subsidence" in w or w.startswith("after")) and "before" not in w  # noqa: E731 (where()'s text)
    for name, st in stats.items():
        pts = (st.get("interference") or {}).get("points", [])
        if not pts:
            continue
        up = [p["sum_Ac_over_G"] for p in pts if not late(p["where"])]
        down = [p["sum_Ac_over_G"] for p in pts if late(p["where"])]
        neg_more = both = 0
        for p in pts:
            cn = [c for a, c in zip(p["A"], p["c"]) if a < 0]
            cp = [c for a, c in zip(p["A"], p["c"]) if a > 0]
            if cn and cp:
                both += 1
                neg_more += mean(cn) > mean(cp)
        verdict = "n/a" if not (up and down) else "for" if mean(up) < mean(down) else "against"
        live = [p["sum_Ac_over_G"] for p in pts if any(a != 0 for a in p["A"])]  # some advantage to act on
        c3.append({"run": name, "before": up, "after": down, "verdict": verdict, "neg_larger": neg_more,
                   "both_signs": both, "negative": sum(x < 0 for x in live), "live": len(live)})
    corr = {k: rank_correlation(*zip(*v)) for k, v in changes.items() if len(v) > 2}
    return {"c4": c4, "c4_rank_correlation": corr, "c3": c3, "changes": changes}


def rank_correlation(x, y, perms=10000, seed=0):
    """Spearman's rho of x and y (ties broken by order) and its two-sided permutation p-value."""
    rx, ry = ranks(torch.tensor(x, dtype=torch.float64)), ranks(torch.tensor(y, dtype=torch.float64))
    rho = pearson(rx, ry)
    g = torch.Generator().manual_seed(seed)
    shuffled = ry[torch.argsort(torch.rand(perms, len(ry), generator=g), dim=1)]
    cx, cy = rx - rx.mean(), shuffled - shuffled.mean(1, keepdim=True)
    null = (cy @ cx) / (cx.norm() * cy.norm(dim=1))
    return {"rho": rho, "p": (1 + (null.abs() >= abs(rho) - 1e-12).sum().item()) / (1 + perms), "n": len(x)}


def plot_grid(infos, controls, path):
    """The experiment at a glance: one row per algorithm, one column per seed, every panel on the same y scale with
    the run's eruption intervals shaded and the no-learning control's smoothed entropy (that seed's, else any) in grey."""
    plt = pyplot()
    lrs = {run_args(i["run"]).get("lr") for i in infos}
    algos = sorted({algo_name(i["run"], lrs) for i in infos}, key=algo_order)
    seeds = sorted({run_args(i["run"]).get("seed", 0) for i in infos})
    fig, axes = plt.subplots(len(algos), len(seeds), figsize=(3.6 * len(seeds), 2.2 * len(algos)), sharex=True,
                             sharey=True, squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for info in infos:
        a, seed = algo_name(info["run"], lrs), run_args(info["run"]).get("seed", 0)
        ax = axes[algos.index(a), seeds.index(seed)]
        ax.set_visible(True)
        c = controls.get(seed) or next(iter(controls.values()), None)
        if c:
            ax.plot(*c, color="0.6", lw=1, ls="--", label="control (lr 0)")
        ax.plot(info["updates"], info["entropy"], color="C0", alpha=0.3, lw=1)
        ax.plot(info["updates"], info["phases"]["smoothed"], color="C0", label="smoothed")
        shade(ax, info)
        ev = held_out(info["run"])
        ax.set_title(f"{a}, seed {seed}: {len(info['eruptions'])} eruption(s)" +
                     (f", held-out {ev['val_success']:.3f}" if ev else ""), fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("entropy (nats)")
    for col in axes.T:  # the lowest panel of each column carries its update axis
        low = [ax for ax in col if ax.get_visible()][-1]
        low.xaxis.set_tick_params(labelbottom=True)
        low.set_xlabel("update")
    next(ax for ax in axes.flat if ax.get_visible()).legend(fontsize=7)
    return save(fig, path)


def analyse_results(args):
    """--results: every figure and table of an experiment folder, from its committed logs only."""
    folder = os.path.normpath(args.results)
    trained, control = experiment_runs(folder)
    if not trained:
        raise SystemExit(f"error: {folder} has no trained run (only lr-0 controls)")
    if args.out_dir == Args.out_dir:
        args.out_dir = os.path.join(F.ROOT, "figures", os.path.basename(folder))
    args.runs, args.control = ",".join(trained), control
    logs = analyse_logs(args)
    infos = [dict(i, run=r) for i, r in zip(logs.pop("infos"), trained)]
    path, rows = results_table(infos, os.path.join(args.out_dir, "table.md"))
    tallies = snapshot_tallies(logs["stats"], args.rise_abs)
    with open(path, "a") as f:
        f.write("\n".join(tallies_markdown(tallies, args.rise_abs) + [""]))
    if tallies["changes"]:
        plot_tallies(tallies, args.rise_abs, os.path.join(args.out_dir, "c4-snapshots.png"))
    controls = {}
    for r in experiment_runs(folder, all_controls=True)[1]:
        u, e = series(load_metrics(r), "entropy")
        controls[run_args(r).get("seed", 0)] = (u, smooth(e, args.smooth))
    grid = plot_grid(infos, controls, os.path.join(args.out_dir, "entropy-grid.png"))
    print(f"wrote {path} and {grid}")
    return dict(logs, table=path, rows=rows, tallies={k: v for k, v in tallies.items() if k != "changes"})


@dataclass
class Args:
    results: str = ""
    """an experiment folder of committed logs, results/<experiment>/<run>/{args.json, metrics.jsonl, eval.jsonl}:
    regenerate its figures, summary.md and table.md (into figures/<experiment> unless --out_dir is given); its lr-0
    run is the control that sets the eruption threshold"""
    runs: str = ""
    """comma-separated training run folders (out_dir of 03/04/05): analyse their logs instead of the lemma checks"""
    both: bool = False
    """with --runs, run the lemma checks as well"""
    lemmas: bool = True
    """run the numerical lemma checks (the mode when no --runs are given)"""
    model: str = ""
    """optional checkpoint to check as well: a Hugging Face id or local folder (e.g. base/tiny)"""
    out_dir: str = os.path.join(F.ROOT, "runs", "analysis")
    """lemmas.json, summary.md, analysis.json and the PNGs are written here"""
    smooth: int = 5
    """window (updates) of the centred moving average applied to the entropy curve before phase labelling"""
    rise: float = 0.2
    """eruption threshold as a fraction of the smoothed entropy curve's range (max - min)"""
    rise_abs: float = 0.0
    """absolute eruption threshold in nats; > 0 overrides --rise"""
    control: str = ""
    """a no-learning run (--lr 0, same seeds and tasks): its entropy noise sets the threshold (see noise_threshold)"""
    rise_sd: float = 4.0
    """with --control: the threshold in units of the sd of a difference of two --smooth-update means of its noise"""
    rescore: bool = False
    """with --runs, re-score the first saved rollout batch under the base and every snapshot (C4; loads the model;
    writes run/rescore.json, which later analyses of the run read back)"""
    rescore_samples: int = 256
    """steps re-scored by --rescore (drawn from the rollouts; and up to as many of the expert's steps)"""
    interference: bool = False
    """with --runs, also compute c_j vs A_j at each run's checkpoint(s) (loads the run's model; writes
    run/interference.json, which later analyses of the run read back)"""
    interference_samples: int = 32
    """trajectory steps per checkpoint for the interference plot"""
    seed: int = 0
    """seed of the random tiny model (lemmas) and of the steps drawn for --interference"""
    vocab_size: int = 64
    """vocabulary of the random-init tiny model"""
    lora_r: int = 16
    """LoRA rank (alpha 32, as in 03)"""
    group_size: int = 6
    """G synthetic responses (one GRPO group) for lemmas 3.2-3.4"""
    w_std: float = 0.1
    """std of the random model's untied W (the 0.02 init would give near-uniform next-token distributions)"""
    lora_b_std: float = 0.02
    """the random model's LoRA B ~ N(0, std^2) instead of 0, so that lora_A gets non-zero gradients"""
    etas: str = "1e-4,1e-5"
    """step sizes for lemma 3.3; the relative error should fall ~10x per decade (first-order accuracy)"""
    fd_step: float = 1e-6
    """central finite-difference step for the lemma 3.4 cross-checks"""
    steps: int = 16
    """sampled responses (steps) for the gradient-norm vs entropy measurement"""
    max_new_tokens: int = 12
    dtype: str = "float64"
    """float64 (exact checks) or float32 (big checkpoints: looser tolerances, finite-difference rows not scored)"""


def main(argv=None):
    args = F.parse_args(Args, argv)
    if args.dtype not in ("float64", "float32"):
        raise SystemExit(f"error: --dtype must be float64 or float32, not {args.dtype!r}")
    if args.smooth < 1 or args.rise < 0 or args.interference_samples < 1:
        raise SystemExit("error: --smooth and --interference_samples must be >= 1 and --rise >= 0")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    report = {"args": asdict(args)}
    if args.lemmas and (not (args.runs or args.results) or args.both):
        kw = dict(seed=args.seed, lora_r=args.lora_r, group_size=args.group_size, dtype=dtype)
        case = build_case(vocab_size=args.vocab_size, w_std=args.w_std, lora_b_std=args.lora_b_std, **kw)
        report["tiny_random"] = run_lemmas(case, args, "random-init tiny Qwen2")
        if args.model:
            model, tok = F.load_pretrained(args.model)
            report["checkpoint"] = run_lemmas(build_case(model, tok, **kw), args, f"checkpoint {args.model}")
        ok = all(all_pass(r) for k, r in report.items() if k != "args")
        report["all_pass"] = ok
        print("all lemma checks passed" if ok else "SOME LEMMA CHECKS FAILED")
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "lemmas.json")
        with open(path, "w") as f:
            json.dump(jsonable(report), f, indent=1)
        print(f"wrote {path}")
    if args.results or args.runs:
        report["logs"] = analyse_results(args) if args.results else analyse_logs(args)
        with open(os.path.join(args.out_dir, "analysis.json"), "w") as f:
            json.dump(jsonable({k: v for k, v in report["logs"].items() if k != "infos"}), f, indent=1)
    return report


if __name__ == "__main__":
    sys.exit(0 if main().get("all_pass", True) else 1)
