"""The CPU speed layer: fast paths that give torch's numbers with less time or memory on the CPU, in one place.

What is here, and who calls it (through these modules' functions only):

* draw.py: the multinomial draw, three exact ways (torch's, numpy's twister, a C loop compiled per machine);
  the decode loop's kernel plan chooses one (rollout/decode.py, rollout/kernels.py).
* linear.py: the decode loop's linear forms for CPU `nn.Linear`s, chosen by the same plan.
* adamw.py: `adamw_for`, the optimizer class the trainer builds (BlockwiseAdamW on the CPU).
* lm_head.py: the output head and per-token log-probs with less memory (models.TokenLogprobs scores through it).
* heap.py: `HeapTrimmer`, glibc's malloc_trim where a CPU step's phases peak.
* machine.py: the CPU's model and flags (kernel choices and native builds are keyed by them).
* torch_internals.py: every reliance on a torch detail that is not public API, each with a `check_*()`;
  paths.py: which fast paths run here (off where a check fails or `GRPO_TRAINER_CPU_PLAIN` names them, warned
  once), and what a run records of it.

Deliberately not here: choosing among alternatives that round differently. That is the decode kernel plan's
(rollout/kernels.py), which is made before a run samples anything and recorded with the run.
"""
