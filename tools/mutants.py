"""One-line silent bugs the test suite must catch (`make mutants`; not part of CI).

Each mutant names a file, the exact original text (found exactly once), its replacement, what
bug it plants, and the tests that should catch it. The runner copies the working tree (the
uncommitted changes included) into a temporary directory once, and for every mutant plants
the change in that copy, runs the mutant's tests there (``PYTHONPATH`` at the copy's own
``_pp/``, so the ranks run the mutated code too) with a timeout, and puts the file back.
A mutant is *caught* when its tests fail (or time out), *survived* when they pass, *stale*
when its original text is no longer in the file (reported, never skipped silently).
tests/test_mutants_static.py checks in CI, without planting anything, that every original
text still occurs exactly once, that the planted file parses and that the named tests exist.

    python tools/mutants.py                 # all mutants; prints caught/total and survivors
    python tools/mutants.py --list          # names, files and descriptions
    python tools/mutants.py --only NAME ... # just these (repeatable / several names)
    python tools/mutants.py --baseline      # first check the mapped tests pass unmutated
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    desc: str
    tests: tuple  # pytest arguments, e.g. "tests/test_x.py::test_y" or "tests/test_x.py -k y"


TP = "tests/test_tensor_parallel.py"
TRAIN = "tests/test_train.py"
CTX = "tests/test_context.py"
EXP = "tests/test_expert.py"
VIT = "tests/test_vit_parallel.py"
A2A = "tests/test_plan_all_to_all.py"
STEP = "tests/test_step_model.py"
FAULTS = "tests/test_faults.py"

MUTANTS = [
    # ------------------------------------------------------------------ TP / SP
    Mutant("tp_f_backward_no_allreduce", "labkit/parallel/tensor/functions.py",
           "        return _all_reduce(grad, ctx.group, _bwd(ctx.tags)), None, None",
           "        return grad, None, None",
           "Megatron's f passes the input gradient through instead of summing it over tp",
           (f"{TP}::test_parity_with_single_process_and_torch[2-tp-kv>=tp-tied]",)),
    Mutant("tp_g_forward_identity", "labkit/parallel/tensor/functions.py",
           "        return _all_reduce(x, group, _fwd(tags))",
           "        return x.clone()",
           "Megatron's g leaves the row-parallel partial sums unreduced",
           (f"{TP}::test_parity_with_single_process_and_torch[2-tp-kv>=tp-tied]",)),
    Mutant("sp_reduce_scatter_avg", "labkit/parallel/tensor/functions.py",
           "    handle = comm.reduce_scatter(out, pieces, group=group, axis=AXIS, async_op=True,",
           "    handle = comm.reduce_scatter(out, pieces, op=\"avg\", group=group, axis=AXIS, "
           "async_op=True,",
           "sequence parallelism's reduce-scatter averages the partial sums instead of summing",
           (f"{TP}::test_parity_with_single_process_and_torch[2-tp+sp-kv>=tp-tied]",)),
    Mutant("sp_gather_interleaved", "labkit/parallel/tensor/functions.py",
           "        out = held.pop().view(n, b, s, *rest).transpose(0, 1).reshape(b, n * s, *rest)",
           "        out = held.pop().view(b, n, s, *rest).reshape(b, n * s, *rest)",
           "the sequence all-gather lays the ranks' pieces out batch-major (wrong rows for B>1)",
           (f"{TP}::test_parity_with_single_process_and_torch[2-tp+sp-kv>=tp-tied]",)),
    Mutant("sp_norm_weight_not_summed", "labkit/parallel/tensor/layers.py",
           "        w = copy_to_tp(self.weight, self.group, **self.tags) if self.sequence_parallel \\",
           "        w = self.weight if self.sequence_parallel \\",
           "SP norm weights (each rank sees S/T tokens) keep a partial gradient, not summed over tp",
           (f"{TP}::test_parity_with_single_process_and_torch[2-tp+sp-kv>=tp-tied]",)),
    Mutant("tp_replicated_kv_grad_not_summed", "labkit/parallel/tensor/attention.py",
           "        w = copy_to_tp(self.weight, self.group, **self.tags)",
           "        w = self.weight",
           "K/V weights replicated when kv_heads < tp keep a partial gradient",
           (f"{TP}::test_parity_with_single_process_and_torch[4-tp-kv<tp-tied]",)),
    # ------------------------------------------------------------------ vocab-parallel CE
    Mutant("ce_no_global_max", "labkit/parallel/tensor/cross_entropy.py",
           "            comm.all_reduce(zmax, op=\"max\", group=group, axis=AXIS, site=\"loss\", "
           "phase=\"forward\")",
           "            pass",
           "each rank shifts its logits by its own max before the exp-sums are added",
           (f"{TP} -k test_vocab_parallel_cross_entropy and plain",)),
    Mutant("ce_target_grad_on_every_rank", "labkit/parallel/tensor/cross_entropy.py",
           "        grad[rows, idx] -= (1 - eps) * mine.to(grad.dtype)",
           "        grad[rows, idx] -= (1 - eps)",
           "the one-hot is subtracted on ranks that do not hold the target column too",
           (f"{TP} -k test_vocab_parallel_cross_entropy and plain",)),
    Mutant("ce_smoothing_local_vocab", "labkit/parallel/tensor/cross_entropy.py",
           "            loss = (1 - smoothing) * loss + smoothing * (log_z - sums[2] / vocab_size)",
           "            loss = (1 - smoothing) * loss + smoothing * (log_z - sums[2] / n_real)",
           "label smoothing divides the summed logits by this rank's vocabulary, not V",
           (f"{TP} -k test_vocab_parallel_cross_entropy and smoothing",)),
    Mutant("ce_mean_counts_ignored", "labkit/parallel/tensor/cross_entropy.py",
           "    return loss.sum() / (t != ignore_index).sum()",
           "    return loss.sum() / t.numel()",
           "the mean loss divides by every token, ignored ones included",
           (f"{TP} -k test_vocab_parallel_cross_entropy and ignore_index",)),
    Mutant("ce_sums_over_world", "labkit/parallel/tensor/cross_entropy.py",
           "            comm.all_reduce(sums, group=group, axis=AXIS, site=\"loss\", "
           "phase=\"forward\")",
           "            comm.all_reduce(sums, group=None, axis=AXIS, site=\"loss\", "
           "phase=\"forward\")",
           "the cross-entropy's exp-sums are all-reduced over the world, not the tp group",
           ("tests/test_independent_counts.py -k tp_subgroups",)),
    # ------------------------------------------------------------------ CP
    Mutant("cp_merge_max_not_logaddexp", "labkit/parallel/context/blocks.py",
           "    new = torch.logaddexp(lse, lse_b)",
           "    new = torch.maximum(lse, lse_b)",
           "the ring's online-softmax merge keeps the larger log-sum-exp instead of adding",
           (f"{CTX} -k test_attention_parity and ring-2-causal",)),
    Mutant("cp_zigzag_not_mirrored", "labkit/parallel/context/layout.py",
           "    return (rank, 2 * cp - 1 - rank) if zigzag else (rank,)",
           "    return (rank, cp + rank) if zigzag else (rank,)",
           "zigzag pairs chunk r with chunk cp+r (not 2cp-1-r): still a partition, unbalanced",
           (f"{CTX} -k zigzag_holds or closed_form_work",)),
    Mutant("cp_rope_positions_rank0", "labkit/train/model_parallel.py",
           "    pos = positions(mg.index(\"cp\"), cfg.parallel.cp, mc.seq_len, cfg.cp_zigzag,",
           "    pos = positions(0, cfg.parallel.cp, mc.seq_len, cfg.cp_zigzag,",
           "every context rank applies rotary embeddings at rank 0's positions",
           (f"{TRAIN}::test_context_parallel_composes_four_ranks[cp2xdp2]",)),
    Mutant("cp_ring_dkv_not_home", "labkit/parallel/context/ring.py",
           "        acc = acc_in\n",
           "        acc = acc\n",
           "the ring's last hop keeps the neighbour's dK/dV accumulator instead of its own",
           (f"{CTX} -k test_attention_parity and ring-2-causal",)),
    Mutant("cp_ulysses_seq_interleaved", "labkit/parallel/context/ulysses.py",
           "    return out.movedim(0, n + 1).reshape(*lead, h // cp, cp * s, d)",
           "    return out.movedim(0, n + 2).reshape(*lead, h // cp, cp * s, d)",
           "Ulysses' all-to-all interleaves the ranks' sequence blocks token by token",
           (f"{CTX} -k test_attention_parity and ulysses-2-causal",)),
    Mutant("cp_work_diagonal_half", "labkit/parallel/context/layout.py",
           "        total += (qc * c * c + c * (c + 1) // 2) if causal else seq_len * c",
           "        total += (qc * c * c + c * c // 2) if causal else seq_len * c",
           "the closed-form causal work counts a diagonal block as c²/2 pairs, not c(c+1)/2",
           ("tests/test_independent_counts.py -k cp_work",)),
    # ------------------------------------------------------------------ EP
    Mutant("ep_combine_unweighted", "labkit/parallel/expert/dispatch.py",
           "        weight = routing.weights.reshape(-1)[choice].to(x.dtype)",
           "        weight = torch.ones_like(routing.weights.reshape(-1)[choice]).to(x.dtype)",
           "the expert-parallel combine sums expert outputs without the router weights",
           (f"{EXP} -k test_layer_parity_without_dropping and 2-2-natural",)),
    Mutant("ep_combine_order", "labkit/parallel/expert/dispatch.py",
           "        outs = outs[torch.argsort(by_expert)]",
           "        outs = outs",
           "expert outputs go back in expert order, not in the order their rows arrived",
           (f"{EXP} -k test_layer_parity_without_dropping and 2-1-natural",)),
    Mutant("ep_counts_not_exchanged", "labkit/parallel/expert/dispatch.py",
           "        recv = recv.view(p, n_local)",
           "        recv = counts.view(p, n_local)",
           "each rank assumes it receives what it sends (its own counts, not the exchanged)",
           (f"{EXP} -k test_layer_parity_without_dropping and 2-1-skewed",)),
    Mutant("ep_expert_grads_averaged", "labkit/train/data_parallel.py",
           "        setup.wrappers.append(DataParallel(holder, mg.group(\"edp\"), \"naive\", "
           "reduce_op=\"sum\",",
           "        setup.wrappers.append(DataParallel(holder, mg.group(\"edp\"), \"naive\", "
           "reduce_op=\"avg\",",
           "expert gradients averaged over their expert-data group (halved at edp=2)",
           (f"{TRAIN}::test_expert_parallel_composes_four_ranks[ep2xdp4]",)),
    Mutant("ep_aux_scale_not_over_cp", "labkit/train/model_parallel.py",
           "        set_aux_loss_scale(m, averaged * cfg.micro / (cfg.global_batch * p.cp))",
           "        set_aux_loss_scale(m, averaged * cfg.micro / cfg.global_batch)",
           "the load-balancing loss of a context rank's forward is not divided by cp",
           (f"{TRAIN}::test_expert_parallel_parity_two_ranks[ep2xcp]",)),
    Mutant("moe_bf16_combine_in_bf16", "labkit/parallel/expert/dispatch.py",
           "        return torch.zeros_like(x).index_add(0, token, back.to(x.dtype) * weight[:, None])",
           "        return torch.zeros_like(x, dtype=back.dtype).index_add(0, token, back * weight["
           ":, None].to(back.dtype)).to(x.dtype)",
           "under bf16 the expert-parallel combine accumulates in bf16, not the fp32 stream",
           ("tests/test_independent_counts.py -k bf16_expert_parallel_combine",)),
    # ------------------------------------------------------------------ N-D reductions
    Mutant("loss_scale_local_batch", "labkit/train/step.py",
           "    return n / (cfg.global_batch * tokens_per_sample(cfg))",
           "    return n / (cfg.local_batch * tokens_per_sample(cfg))",
           "the loss is divided by the local batch's tokens: every gradient ×dp (AdamW hides it)",
           ("tests/test_grad_scale.py -k training and fp32-0",)),
    Mutant("torch_ddp_average_not_undone", "labkit/train/step.py",
           "    n = setup.mg.size(\"dp_cp\") if cfg.impl == \"torch\" else 1",
           "    n = 1",
           "PyTorch DDP's averaging is not undone: every gradient ÷dp (AdamW hides it)",
           (f"{TRAIN} -k test_parity_two_ranks and torch-ddp",)),
    Mutant("ddp_job_averages", "labkit/train/data_parallel.py",
           "                                 reduce_op=\"sum\",",
           "                                 reduce_op=\"avg\",",
           "the job's DDP averages where the loss rule needs a sum (every gradient ÷dp)",
           ("tests/test_grad_scale.py -k training and fp32-0",)),
    Mutant("zero_bf16_job_averages", "labkit/train/data_parallel.py",
           "        kw = dict(mixed_precision=mixed, reduce_op=\"sum\")",
           "        kw = dict(mixed_precision=mixed, reduce_op=\"avg\" if mixed else \"sum\")",
           "bf16 ZeRO in the job averages where it sums (every gradient halved at dp=2)",
           ("tests/test_grad_scale.py -k training and bf16",)),
    Mutant("tp_loss_counted_per_rank", "labkit/train/__init__.py",
           "    first_of_tp = setup.mg.index(\"tp\") == 0  # every tp rank holds the same loss",
           "    first_of_tp = True",
           "the global loss adds every tp rank's (identical) share: reported loss ×tp",
           (f"{TRAIN}::test_tensor_parallel_parity_two_ranks[tp2]",)),
    Mutant("tied_pp_grads_averaged", "labkit/parallel/pipeline/stage.py",
           "        g.add_(other)  # a + b == b + a exactly: both copies stay bit-identical",
           "        g.add_(other).mul_(0.5)",
           "the tied embedding's two pipeline copies average their gradients instead of summing",
           (f"{TRAIN}::test_parity_two_ranks[pp2-1f1b]",)),
    Mutant("hsdp_replicas_summed", "labkit/parallel/zero/sharded.py",
           "            hs = [comm.all_reduce(g, op=self.reduce_op, group=self.replicate_group,",
           "            hs = [comm.all_reduce(g, op=\"sum\", group=self.replicate_group,",
           "HSDP sums over the replicas even when the wrapper averages",
           ("tests/test_dp_wrappers.py -k every_accumulation and hsdp2-last",)),
    Mutant("comm_avg_is_sum", "labkit/comm.py",
           "    finish = (lambda: tensor.div_(n)) if op == \"avg\" else None",
           "    finish = None",
           "all-reduce op='avg' returns the sum (the wrappers' default reduction doubles)",
           ("tests/test_grad_scale.py -k wrapper and naive",)),
    # ------------------------------------------------------------------ accounting
    Mutant("bytes_measured_is_predicted", "labkit/train/metrics.py",
           "    return {\"comm_bytes_by_axis\": measured, \"comm_predicted_by_axis\": predicted,",
           "    return {\"comm_bytes_by_axis\": predicted, \"comm_predicted_by_axis\": predicted,",
           "the job reports its predicted bytes per axis as measured",
           ("tests/test_measured.py -k bytes and dp2",)),
    Mutant("memory_measured_is_predicted", "labkit/train/metrics.py",
           "           \"model_state\": {c: max(s.get(c, 0) for s in marks)",
           "           \"model_state\": {c: predicted_memory(setup)[c]",
           "the job reports its predicted parameter/gradient/optimizer bytes as measured",
           ("tests/test_measured.py -k memory and dp2",)),
    Mutant("comm_all_reduce_bytes_half", "labkit/comm.py",
           "group=group, axis=axis, sent=2 * (n - 1) * s / n, recv=2 * (n - 1) * s / n,",
           "group=group, axis=axis, sent=(n - 1) * s / n, recv=2 * (n - 1) * s / n,",
           "an all-reduce is counted as sending (N-1)/N·S, not 2(N-1)/N·S",
           ("tests/test_measured.py -k bytes and dp2",)),
    Mutant("tp_state_kv_split", "labkit/parallel/tensor/measure.py",
           "    kv = 2 * k * d * h // (tp if k >= tp else 1)",
           "    kv = 2 * k * d * h // tp",
           "the TP memory prediction splits K/V over tp even when kv_heads < tp (replicated)",
           (f"{TP} -k test_model_state_bytes",)),
    Mutant("zero_predicted_state_unpadded", "labkit/train/metrics.py",
           "        padded = sum(u.padded for w in setup.sharded for u in w.units)",
           "        padded = sum(u.numel for w in setup.sharded for u in w.units)",
           "the ZeRO memory prediction forgets the flat units' padding to K elements",
           ("tests/test_measured.py -k memory and padded",)),
    Mutant("plan_zero2_grads_whole", "labkit/plan/memory.py",
           "    sharded = {0: (), 1: (\"optimizer\",), 2: (\"optimizer\", \"gradients\"),",
           "    sharded = {0: (), 1: (\"optimizer\",), 2: (\"optimizer\",),",
           "the planner's ZeRO-2 keeps whole gradients on every rank",
           ("tests/test_zero.py -k memory_exactly", "tests/test_plan.py")),
    Mutant("plan_all_gather_factor", "labkit/plan/comm.py",
           "        return 2.0 * (n - 1) / n",
           "        return 2.0 * n / (n + 1)",
           "the planner's all-reduce factor 2n/(n+1) instead of 2(n-1)/n",
           ("tests/test_dp.py -k allreduce_bytes_equal_formula", "tests/test_plan.py")),
    Mutant("flops_cp_not_divided", "labkit/train/flops.py",
           "    return tp_i * p.cp + cp_i, p.tp * p.cp",
           "    return tp_i, p.tp",
           "the per-rank FLOP count is not divided by cp (each cp rank reports the sequence's)",
           ("tests/test_flops_share.py -k add_up", "tests/test_matrix.py -k cp2")),
    Mutant("flops_tp_not_divided", "labkit/train/flops.py",
           "    return share(ctx.cache[key] * cfg.accum_steps, parts, index)",
           "    return ctx.cache[key] * cfg.accum_steps // cfg.parallel.cp",
           "each tp rank reports the whole replica's FLOPs (MFU ×tp)",
           ("tests/test_flops_share.py -k tp_job", "tests/test_matrix.py -k tp2")),
    # ------------------------------------------------------------------ this release's fixes
    Mutant("router_top1_renormalised", "labkit/models/router.py",
           "    weights = top_p if top_k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)",
           "    weights = top_p / top_p.sum(dim=-1, keepdim=True)",
           "top-1 weights renormalised to 1.0: the LM loss never reaches the router",
           ("tests/test_router_gradient.py", "tests/test_matrix.py -k top1")),
    Mutant("ddp_unused_gets_zeros", "labkit/parallel/dp/ddp.py",
           "                if id(p) not in used:\n                    continue",
           "                if False:\n                    continue",
           "a parameter no rank used gets a zero gradient (AdamW's decay then moves it)",
           ("tests/test_dp_wrappers.py -k unused_parameters_match",)),
    Mutant("row_bias_dropped", "labkit/parallel/tensor/layers.py",
           "        return y + b\n",
           "        return y\n",
           "the row-parallel bias is never added",
           ("tests/test_tensor_bias.py",)),
    Mutant("torch_pp_shape_inference_counted", "labkit/train/pipeline.py",
           "    if infer is None or not layers:",
           "    if True:",
           "torch pipelining's shape-inference forward counts into step 0's expert loads",
           ("tests/test_matrix.py -k torch and zb-v",)),
    Mutant("dualpipe_bw_leaves_dw_in_store", "labkit/parallel/pipeline/executor.py",
           '                if kind == "BW" and self.store is not None:',
           '                if False:',
           "a full backward on split linears (DualPipeV mixes them) leaves dW in the store",
           ("tests/test_pipeline_dualpipe.py -k parity",)),
    Mutant("dualpipe_split_from_the_wrong_pair", "labkit/parallel/pipeline/zero_bubble.py",
           "        split, half = False, (r + 1) // 2",
           "        split, half = False, r // 2",
           "DualPipeV's cool-down starts its split backwards one pair early on odd ranks",
           ("tests/test_pipeline_dualpipe.py -k order",)),
    Mutant("tp_v_tied_head_own_shard", "labkit/train/model_parallel.py",
           "    _retie_vocab_shard(setup)\n",
           "    pass\n",
           "tp x a V schedule: the tied head keeps its own vocabulary shard on the rank holding "
           "both ends, so its gradient never reaches the embedding",
           ("tests/test_pipeline_dualpipe.py -k tied",)),
    Mutant("dualpipe_w_dropped", "labkit/parallel/pipeline/zero_bubble.py",
           "                seq.append(wq.pop(0))",
           "                wq.pop(0)",
           "DualPipeV never runs its W passes (weight gradients of split backwards lost)",
           ("tests/test_pipeline_dualpipe.py",)),
    Mutant("cp_work_ulysses_own_share", "labkit/parallel/context/measure.py",
           "        every = sum(causal_pairs_closed_form(r, cp, seq_len, zigzag, causal) for r in "
           "range(cp))",
           "        every = cp * causal_pairs_closed_form(rank, cp, seq_len, zigzag, causal)",
           "Ulysses' work taken as cp × this rank's ring share (right only for zigzag)",
           ("tests/test_independent_counts.py -k cp_work",)),
    Mutant("cp_work_ignores_causal", "labkit/parallel/context/measure.py",
           "    return batch * heads * causal_pairs_closed_form(rank, cp, seq_len, zigzag, causal)",
           "    return batch * heads * causal_pairs_closed_form(rank, cp, seq_len, zigzag, True)",
           "the closed-form work ignores causal=False (non-causal attention counted as causal)",
           (f"{CTX} -k measured_work", "tests/test_independent_counts.py -k cp_work")),
    Mutant("step_loss_host_read", "labkit/train/step.py",
           "            total += loss_sum.detach().double()",
           "            total += loss_sum.item()",
           "each microbatch's loss is read by the host (a GPU sync per microbatch)",
           ("tests/test_device_placement.py -k ulysses",)),
    Mutant("pipeline_flush_host_read", "labkit/parallel/pipeline/executor.py",
           "        return torch.stack(losses).sum().detach().double() if losses \\",
           "        return torch.tensor(float(torch.stack(losses).sum()), dtype=torch.float64) if losses \\",
           "each pipeline flush's loss is read by the host (a GPU sync per flush)",
           ("tests/test_device_placement.py -k 1f1b",)),
    Mutant("step_tensor_on_host", "labkit/train/step.py",
           "                loss = loss_sum * scale",
           "                loss = (loss_sum * torch.full((1,), scale)).sum()",
           "a tensor of the step is made on the CPU, not on the rank's device",
           ("tests/test_device_placement.py -k ulysses",)),

    # ------------------------------------------------------------------ model state
    Mutant("state_step_counters_dropped", "labkit/train/metrics.py",
           '    out["optimizer"] += 4 * sum(len(g["params"]) for g in setup.opt.param_groups)',
           '    out["optimizer"] += 0',
           "the predicted optimizer state leaves out AdamW's step counters",
           ("tests/test_matrix.py -k z1-sp-dense-gqa-acc2",)),
    Mutant("state_fsdp2_root_sharded", "labkit/train/metrics.py",
           "        out[\"parameters\"] += sum(fsdp2_shard_elements(p)[0] * _shards(p) for p in root) \\",
           "        out[\"parameters\"] += 0 * sum(fsdp2_shard_elements(p)[0] for p in root) \\",
           "FSDP2's unsharded root parameters are predicted sharded (the replicated/sharded mixup)",
           ("tests/test_matrix.py -k z3-hsdp2-top1cap-untied-torch",)),
    Mutant("state_total_counts_replicas", "tests/test_matrix.py",
           "            if sharded[c] or first:",
           "            if True:",
           "the layout-invariance rule counts state ZeRO does not shard on every data rank "
           "(replicas counted more than once): the layouts must then disagree",
           ("tests/test_matrix.py -k layout_invariance_of_total_model_state",)),
    # ------------------------------------------------------------------ ViT tp/sp/cp (C45)
    Mutant("vit_cp_pool_backward_identity", "labkit/parallel/vision.py",
           '        comm.all_reduce(out, group=ctx.group, axis="cp", site="vit_pool", phase="backward")',
           "        pass",
           "the ViT's pooled token sum passes its gradient through instead of summing it over cp",
           (f"{VIT}::test_vit_layouts_match_the_oracle_on_every_rank",)),
    Mutant("vit_cp_loss_not_shared", "labkit/parallel/vision.py",
           "        return F.cross_entropy(logits.float(), targets, reduction=reduction) / cp",
           "        return F.cross_entropy(logits.float(), targets, reduction=reduction)",
           "every cp rank takes the whole per-image loss: gradients cp times too large",
           (f"{VIT}::test_vit_layouts_match_the_oracle_on_every_rank",)),
    Mutant("vit_cp_causal_mask", "labkit/parallel/vision.py",
           "        core = make_attention_core(cp_method, cp_group, causal=False, zigzag=zigzag,",
           "        core = make_attention_core(cp_method, cp_group, causal=True, zigzag=zigzag,",
           "the ViT's context-parallel attention masks the future (a decoder's mask on an encoder)",
           (f"{VIT}::test_vit_layouts_match_the_oracle_on_every_rank",)),
    Mutant("vit_sp_pool_not_reduced", "labkit/parallel/vision.py",
           '                s = reduce_from_tp(s, tp_group, site="vit_pool")',
           "                s = s",
           "with sequence parallelism each tp rank pools only its own S/T tokens",
           (f"{VIT}::test_vit_layouts_match_the_oracle_on_every_rank",)),
    Mutant("vit_patch_tokens_strided", "labkit/models/vit.py",
           "        x = self.patch_emb(images).flatten(2).transpose(1, 2).contiguous()   # (B, P, H)",
           "        x = self.patch_emb(images).flatten(2).transpose(1, 2)   # (B, P, H)",
           "the ViT's residual stream stays a transposed view: each matmul saves its own copy",
           (f"{VIT}::test_planned_vit_activations_equal_the_measured_bytes",)),
    Mutant("tp_bf16_residual_counted_bf16", "labkit/train/comm_predict.py",
           "    res = 2 if _bf16_weights(setup) else 4\n    return act, res, res",
           "    res = act\n    return act, res, res",
           "tp bytes under bf16 autocast counted all-bf16 (the residual side moves fp32)",
           ("tests/test_matrix.py -k bf16-ckpt-every",)),
    # ------------------------------------------------------------------ planner: all-to-all
    Mutant("plan_a2a_nics_pooled", "labkit/plan/network.py",
           "    t_out = across / (placement.nic_bandwidth * link_efficiency) if across else 0.0",
           "    t_out = across / (g * placement.nic_bandwidth * link_efficiency) if across else 0.0",
           "an all-to-all's cross-server bytes use the server's g adapters pooled (as a ring's), "
           "not the rank's own",
           (f"{A2A}::test_switched_all_to_all_uses_nvlink_inside_and_each_gpus_adapter_across",)),
    Mutant("plan_a2a_node_limit_ignored", "labkit/plan/experts.py",
           "            hit = min(hit, model.node_limit)",
           "            hit = hit",
           "DeepSeek-V3's node-limited routing (at most 4 servers a token) is not applied",
           (f"{A2A}::test_deepseek_v3_layer_all_to_all_by_hand",)),
    Mutant("plan_a2a_dualpipe_all_unpaired", "labkit/plan/steptime.py",
           "    unpaired = min(1.0, (p - 1) / mb) if r.ep_overlap and p > 1 else 0.0",
           "    unpaired = 1.0 if r.ep_overlap and p > 1 else 0.0",
           "DualPipe's all-to-all exposed in every chunk, not only warm-up and cool-down's",
           (f"{A2A}::test_exposed_all_to_all_follows_the_runtime_overlap",)),
    # ------------------------------------------------------------------ planner: working set
    Mutant("plan_working_set_gate_up_freed_early", "labkit/plan/working_set.py",
           "        r.free(\"silu\")\n        out = row_out(\"w2\")\n"
           "        r.free(\"product\", \"gate\", \"up\")",
           "        r.free(\"silu\", \"gate\", \"up\")\n        out = row_out(\"w2\")\n"
           "        r.free(\"product\")",
           "the replayed tensor-parallel SwiGLU frees gate and up before w2 (autograd keeps them "
           "until the block's output)",
           ("tests/test_fake_rank.py::test_405b_layer_working_set_is_the_mlps_reduce_scatter",)),
    # ------------------------------------------------------------------ step model
    Mutant("step_model_overlapped_as_blocking", "labkit/measure/step_model.py",
           "        out[id(e)] = OVERLAPPED if any(e.start < s < e.end for s in starts) else BLOCKING",
           "        out[id(e)] = BLOCKING",
           "a call the rank computed through (DDP's buckets, FSDP's prefetch) is priced as "
           "blocking",
           (f"{STEP}::test_blocking_call_costs_its_prediction_overlapped_only_what_compute_does_"
            "not_hide",)),
    Mutant("step_model_collective_before_last_member", "labkit/measure/step_model.py",
           "                    if gk not in resolved and all(m in got for m in members):\n"
           "                        resolved[gk] = max(got[m] for m in members) + price(e)",
           "                    if gk not in resolved:\n"
           "                        resolved[gk] = max(got.values()) + price(e)",
           "a collective starts when its first member arrives, not its last",
           (f"{STEP}::test_a_collective_starts_when_its_last_member_arrives",)),
    Mutant("step_model_pipeline_p2p_dropped", "labkit/measure/step_model.py",
           "        link = sum(price(e) for e in p2p) / len(p2p) if p2p else 0.0",
           "        link = 0.0",
           "the pipeline's stage-to-stage transfers are left off the simulated critical path",
           (f"{STEP}::test_pipeline_bubble_and_p2p_on_the_critical_path",)),
    Mutant("link_share_worst_case_always", "labkit/measure/link_share.py",
           "        out[key] = (per_node / g) / k",
           "        out[key] = 1.0",
           "a call crossing a node boundary always gets the planner's worst-case share of the "
           "node's link, whatever overlap the trace shows",
           ("tests/test_link_share.py",)),
    Mutant("link_share_own_group_counted", "labkit/measure/link_share.py",
           "                others = [(o.start, o.end, om) for o, om in calls if om != m]",
           "                others = [(o.start, o.end, om) for o, om in calls]",
           "the call's own group's ranks counted as other flows on the node's link",
           ("tests/test_link_share.py -k whole_link",)),
    Mutant("links_pairs_assume_block", "labkit/collectives/links.py",
           "    inside, across = link_pairs(cluster)",
           "    inside, across = (0, 1), (0, per)",
           "the links' inside/across pairs assume block placement (a cyclic cluster's pair "
           "across is timed as inside)",
           ("tests/test_link_share.py -k pairs",)),
    Mutant("links_fit_hop_mean", "labkit/measure/hierarchy.py",
           "    a = statistics.median(t - x * b for x, t in pts)",
           "    a = statistics.mean(t - x * b for x, t in pts)",
           "the links' hop is the mean residual: one slow tiny call sets every call's latency",
           ("tests/test_link_share.py -k links_line",)),
    Mutant("links_fit_slope_all_sizes", "labkit/measure/hierarchy.py",
           "    cut = min(big, sizes[-2])",
           "    cut = sizes[0]",
           "the links' busbw from a line through every size (small calls bend the slope)",
           ("tests/test_link_share.py -k links_line",)),
    # ------------------------------------------------------------------ widgets, overlap
    Mutant("pipeline_view_draws_first_flush", "widgets/pipeline_view.py",
           "        self.spans = measured_spans(trace, *self.drawn[:2]) if self.drawn else []",
           "        self.spans = measured_spans(trace, self.drawn[0], 0) if self.drawn else []",
           "with several flushes a step the measured panel draws flush 0 while its title "
           "names the last flush measured",
           ("tests/test_pipeline_view.py -k several_flushes",)),
    Mutant("pipeline_v_slider_keeps_old_value", "widgets/pipeline_controls.py",
           "                w.options, w.disabled = (need,), True\n                w.value = need",
           "                w.disabled = True",
           "the disabled V slider keeps the V last chosen (4 beside a title saying V=2)",
           ("tests/test_pipeline_view.py -k disabled_v_slider",)),
    Mutant("pipeline_refused_v_comes_back", "widgets/pipeline_controls.py",
           "            self._v_chosen = V_OPTIONS[0]  # interleaved chosen again must not "
           "bring it back",
           "            pass",
           "a V refused with interleaved comes back each time interleaved is chosen again",
           ("tests/test_pipeline_view.py -k waits_for_interleaved",)),
    Mutant("overlap_counts_cp_gathers", "labkit/train/overlap.py",
           'DP_AXES = ("dp", "dp_shard", "dp_replicate", "dp_cp", "fsdp")',
           'DP_AXES = ("dp", "dp_shard", "dp_replicate", "dp_cp", "fsdp", "cp")',
           "the overlap figure counts context parallelism's blocking K/V all-gathers",
           ("tests/test_overlap.py -k context_parallel",)),
    # ------------------------------------------------------------------ faults, snapshots
    Mutant("fault_stall_in_backend_not_detected", "labkit/faults/diagnose.py",
           "    if missing:\n        return report\n",
           "    if missing:\n        return report\n    return None\n",
           "a collective every member entered and none left (a stall inside the backend) is "
           "not reported as a hang",
           (f"{FAULTS}::test_a_stall_inside_the_backend_is_diagnosed_without_ranks",)),
    Mutant("fault_live_straggler_first_steps", "labkit/faults/straggler.py",
           "        last = list(units.values())[-window:]",
           "        last = list(units.values())[:window]",
           "the live straggler rule looks at a group's first steps, not its latest",
           (f"{FAULTS}::test_live_straggler_from_flight_records_without_ranks",)),
    Mutant("snapshot_fsdp2_even_chunk_offsets", "labkit/snapshot/state.py",
           "                local_shape, base = tuple(chunk.sizes), tuple(chunk.offsets)",
           "                local_shape, base = tuple(chunk.sizes), (p.device_mesh.get_local_rank()"
           " * chunk.sizes[0], *chunk.offsets[1:])",
           "a FSDP2 chunk's global offset taken as rank × its own rows (right only for even "
           "chunks; FSDP2's last ranks hold fewer rows, or none)",
           ("tests/test_snapshot.py::test_snapshot_holds_the_reference_state",)),
    # ------------------------------------------------------------------ the matrix's ViT and DualPipeV
    Mutant("vit_flops_policy_skipped", "labkit/train/flops.py",
           "    stages = [model] if mc.kind == \"vit\" else \\\n",
           "    stages = [] if mc.kind == \"vit\" else \\\n",
           "a checkpointed ViT's hardware FLOPs leave out the recomputed forward",
           (f"{VIT} -k checkpointed", "tests/test_matrix.py -k vit and ckpt-full")),
    Mutant("memory_own_params_untagged", "labkit/measure/memory_tracker.py",
           "                self._update_and_maybe_create_winfos(prm, _MemRefType.PARAM)",
           "                pass",
           "FSDP2's unsharded root-held parameters (ViT class token, positions) measured as "
           "activations",
           (f"{VIT} -k fsdp2",)),
    Mutant("vit_cls_grad_view", "labkit/models/vit.py",
           "            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1) * 1.0, x), dim=1)",
           "            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)",
           "one image per microbatch: the class token's .grad is a view keeping the whole "
           "sequence's gradient alive",
           (f"{VIT} -k class_token",)),
    Mutant("tp_ckpt_segment_as_blocks", "labkit/train/comm_predict.py",
           "        outputs = layers if mc.n_experts else 2 * layers - segments",
           "        outputs = layers",
           "tp bytes of a checkpoint segment of several blocks predicted as one segment per "
           "block (the earlier blocks' MLP output collectives are repeated too)",
           ("tests/test_train.py -k every2",)),
    Mutant("state_fsdp2_root_without_fsdp", "labkit/train/metrics.py",
           '                if not n.startswith("layers.") and getattr(p, "placements", None) is not None]',
           '                if not n.startswith("layers.")]',
           "impl='torch' ZeRO 3 on one data rank (no fully_shard) predicts the root's "
           "parameters twice",
           ("tests/test_zero.py -k one_data_rank", "tests/test_matrix.py -k dp1 and z3 and torch")),
    Mutant("vit_sp_final_norm_plain", "labkit/parallel/vision.py",
           '        model.norm = ParallelRMSNorm(model.norm, tp_group, **kw, tags={"site": "norm_grad"})',
           "        pass",
           "with sequence parallelism the ViT's final norm weight gradient is not summed over tp",
           ("tests/test_matrix.py -k vit and sp",)),
]


def _copy_tree(dst: Path) -> None:
    """The working tree as it is (uncommitted changes included), without caches and build
    debris; a fresh ``_pp`` of links to the copy's packages."""
    skip = shutil.ignore_patterns("__pycache__", ".venv", "artifacts", ".pytest_cache", ".git",
                                  "_pp", "node_modules", ".ipynb_checkpoints", "*.egg-info")
    for name in ("labkit", "widgets", "tests", "tools", "pyproject.toml", "notebooks",
                 "benchmarks", "docs"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=skip, symlinks=True)
        elif src.exists():
            shutil.copy2(src, dst / name)
    (dst / "_pp").mkdir()
    (dst / "_pp" / "labkit").symlink_to("../labkit")
    (dst / "_pp" / "labkit_widgets").symlink_to("../widgets")


def _pytest(tree: Path, tests: tuple, timeout: float) -> tuple:
    """``(rc, seconds, tail)`` of the mutant's tests in ``tree``; rc ``None`` on a timeout."""
    args = []
    for t in tests:  # "FILE[::NODE] [-k EXPRESSION]": the expression is one argument
        head, _, expr = t.partition(" -k ")
        args.append(shlex.split(head) + (["-k", expr] if expr else []))
    env = dict(os.environ, PYTHONPATH=str(tree / "_pp"), PYTHONDONTWRITEBYTECODE="1",
               COLUMNS="240")  # room for the failure message in the short summary
    t0, tail, rc = time.time(), "", 0
    for sel in args:  # each selection separately, stopping at the first that fails
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *sel]
        try:
            p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                               timeout=max(1.0, timeout - (time.time() - t0)),
                               start_new_session=True)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            return None, time.time() - t0, out[-800:]
        rc, tail = p.returncode, p.stdout[-1500:] + p.stderr[-500:]  # the summary: stdout's end
        if rc != 0:
            break
    return rc, time.time() - t0, tail


def _failures(tail: str, n: int = 2) -> list:
    """pytest's short-summary lines (``FAILED node - message``) in ``tail``, the first
    ``n``, each cut to one screen line: whether a mutant was caught for the right reason."""
    lines = [x for x in tail.splitlines() if x.startswith(("FAILED ", "ERROR "))]
    return [x if len(x) <= 240 else x[:237] + "..." for x in lines[:n]]


def run(mutants, timeout: float, baseline: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="labkit-mutants-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        if baseline:
            for m in mutants:
                rc, secs, tail = _pytest(tree, m.tests, timeout)
                print(f"baseline {m.name}: rc={rc} ({secs:.0f} s)", flush=True)
                if rc != 0:
                    print(tail, flush=True)
        caught, survived, stale, errors = [], [], [], []
        for m in mutants:
            path = tree / m.file
            text = path.read_text() if path.exists() else ""
            if text.count(m.old) != 1:
                stale.append(m)
                print(f"STALE    {m.name}: original text found {text.count(m.old)}× in "
                      f"{m.file}", flush=True)
                continue
            path.write_text(text.replace(m.old, m.new))
            try:
                rc, secs, tail = _pytest(tree, m.tests, timeout)
            finally:
                path.write_text(text)
            if rc == 0:
                survived.append(m)
                print(f"SURVIVED {m.name} ({secs:.0f} s): {m.desc}", flush=True)
            elif rc in (None, 1):  # tests failed, or hung (a mutant that deadlocks ranks)
                caught.append(m)
                how = "timeout" if rc is None else "tests failed"
                print(f"caught   {m.name} ({how}, {secs:.0f} s)", flush=True)
                for line in _failures(tail):  # which test failed, and on what
                    print(f"   {line}", flush=True)
            else:  # pytest itself failed (no tests collected, usage error): not a catch
                errors.append(m)
                print(f"ERROR    {m.name} (pytest rc={rc}, {secs:.0f} s)\n   "
                      + tail.strip().replace("\n", "\n   ")[-400:], flush=True)
    total = len(mutants)
    print(f"\nmutants caught: {len(caught)}/{total}"
          + (f"; stale: {len(stale)}" if stale else "")
          + (f"; test errors: {len(errors)}" if errors else ""))
    for m in survived:
        print(f"  survivor {m.name} ({m.file}): {m.desc}; tests {', '.join(m.tests)}")
    for m in stale:
        print(f"  stale    {m.name} ({m.file}): update its original text")
    for m in errors:
        print(f"  error    {m.name}: its tests did not run ({', '.join(m.tests)})")
    return 0 if not (survived or stale or errors) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--only", nargs="+", action="extend", metavar="NAME",
                    help="run only these mutants")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per mutant")
    ap.add_argument("--baseline", action="store_true",
                    help="first run every selected mutant's tests on the unmutated copy")
    a = ap.parse_args(argv)
    chosen = MUTANTS
    if a.only:
        names = {m.name for m in MUTANTS}
        unknown = sorted(set(a.only) - names)
        if unknown:
            ap.error(f"unknown mutant(s) {unknown}; see --list")
        chosen = [m for m in MUTANTS if m.name in set(a.only)]
    if a.list:
        for m in chosen:
            print(f"{m.name:34s} {m.file}\n    {m.desc}\n    tests: {'; '.join(m.tests)}")
        print(f"{len(chosen)} mutants")
        return 0
    return run(chosen, a.timeout, a.baseline)


if __name__ == "__main__":
    sys.exit(main())
