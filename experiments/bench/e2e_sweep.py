"""The named configurations of `e2e_bench.py sweep NAMES` (`sweep --list` prints them): each
name's e2e_bench.py arguments, one configuration per process."""

# One row per micro-batch, 32 per step (configs/8k.py takes two rows x 16 since 2026-12-03).
ONE_ROW = "--set opt.batch_size=1 --set opt.accum_steps=32"
# name -> command-line arguments of one configuration
SWEEP = {
    "8k": "student --config configs/8k.py --docs 4 --memory",
    "8k-f32acc": "student --config configs/8k.py --docs 4 --set opt.accum_dtype=float32",
    "8k-1doc": "student --config configs/8k.py --docs 1",
    "8k-bf16state": "student --config configs/8k.py --docs 4 --set opt.state_dtype=bfloat16",
    "8k-host": "student --config configs/8k.py --docs 4 --set opt.state_memory=host",
    # What each block keeps for its backward pass (kdjax/models/remat.py), one row per
    # micro-batch; "8k" is the config's (auto, two rows).
    "8k-none": "student --config configs/8k.py --docs 4 --memory --set "
               f"student.remat=none {ONE_ROW}",
    "8k-names": "student --config configs/8k.py --docs 4 --memory --set "
                f"student.remat=names {ONE_ROW}",
    "8k-dots": "student --config configs/8k.py --docs 4 --memory --set "
               f"student.remat=dots {ONE_ROW}",
    "8k-dots_attention": "student --config configs/8k.py --docs 4 --memory --set "
                         f"student.remat=dots_attention {ONE_ROW}",
    "8k-offload": "student --config configs/8k.py --docs 4 --memory --set "
                  f"student.remat=offload {ONE_ROW}",
    "8k-full": "student --config configs/8k.py --docs 4 --memory --set "
               f"student.remat=full {ONE_ROW}",
    # Within 48 GiB another way: AdamW's moments (24 GiB at 3.2B parameters) in pinned host
    # memory, so a richer remat policy fits beside the step's activations.
    "8k-48g-dots_attention": "student --config configs/8k.py --docs 4 --memory --set "
                             f"student.remat=dots_attention --set opt.state_memory=host {ONE_ROW}",
    "8k-48g-dots": "student --config configs/8k.py --docs 4 --memory --set "
                   f"student.remat=dots --set opt.state_memory=host {ONE_ROW}",
    # Two rows per micro-batch (16 of them per step), the same 32 x 8K tokens.
    "8k-none-b2": "student --config configs/8k.py --docs 4 --memory --set student.remat=none "
                  "--set opt.batch_size=2 --set opt.accum_steps=16",
    "8k-names-b2": "student --config configs/8k.py --docs 4 --memory --set student.remat=names "
                   "--set opt.batch_size=2 --set opt.accum_steps=16",
    "8k-accum1": "student --config configs/8k.py --docs 4 --accum 1 --steps 6",
    # configs/8k.py, 32k.py and 128k.py train the block's projections in FP8 (student.fp8_matmuls,
    # kdjax/models/fp8.py; the projections alone: experiments/bench/fp8_bench.py), so "8k",
    # "8k-48g-dots_attention", "32k" and "128k" run FP8; these are their bf16 baselines (remat
    # auto plans each anew). Lines before the FP8 default (2026-12-06) named bf16 runs "8k",
    # "32k", ... and FP8 ones "8k-fp8", ...
    "8k-bf16": "student --config configs/8k.py --docs 4 --memory --set student.fp8_matmuls=False",
    "8k-48g-bf16": "student --config configs/8k.py --docs 4 --memory --set "
                   f"student.remat=dots_attention --set opt.state_memory=host {ONE_ROW} "
                   "--set student.fp8_matmuls=False",
    "32k-bf16": "student --config configs/32k.py --docs 8 --steps 2 "
                "--set student.fp8_matmuls=False",
    "128k-bf16": "student --config configs/128k.py --docs 16 --accum 1 --steps 4 --memory "
                 "--set student.fp8_matmuls=False",
    # Rows as real text packs: this Python's stdlib files as documents (1 per 8K row at the
    # median, 33 at most; 4 and 48 at 32K: experiments/studies/documents_per_row.py), so the run's
    # documents bound is the fullest row's where the entries above hold 4 or 8 in every row.
    "8k-stdlib": "student --config configs/8k.py --docs stdlib --memory",
    "32k-stdlib": "student --config configs/32k.py --docs stdlib --steps 2",
    # The same with each micro-batch's own documents bound (opt.documents_bound): more compiled
    # programs (at most log2(T)), fewer empty cuDNN calls per layer.
    "8k-stdlib-mb": "student --config configs/8k.py --docs stdlib --memory "
                    "--set opt.documents_bound=micro_batch",
    "32k-stdlib-mb": "student --config configs/32k.py --docs stdlib --steps 2 "
                     "--set opt.documents_bound=micro_batch",
    "32k": "student --config configs/32k.py --docs 8 --steps 2",
    "32k-dots": "student --config configs/32k.py --docs 8 --steps 2 --memory --set student.remat=dots "
                "--mem-fraction 0.92",
    "32k-dots_attention": "student --config configs/32k.py --docs 8 --steps 2 --memory --set "
                          "student.remat=dots_attention --mem-fraction 0.92",
    # "names" keeps the attention's output and log-normalisers since f866861 (no second attention
    # forward): where auto's order puts it against "dots" is to be measured.
    "32k-names": "student --config configs/32k.py --docs 8 --steps 2 --memory --set "
                 "student.remat=names --mem-fraction 0.92",
    "32k-attention": "student --config configs/32k.py --docs 8 --steps 2 --memory --set "
                     "student.remat=attention --mem-fraction 0.92",
    # AdamW's moments in host memory free 24 GiB: XLA's H200 plan made on CPU then fits remat
    # "none" at 32K (86.3 GiB of temporaries + 18.0 resident + cuDNN's workspace, ~108 of 115.1;
    # experiments/studies/plan_on_cpu.py), which auto takes first. At 8K none was 4.6% faster than
    # dots_attention and the moments' trips cost 0.72 s a step: to be measured against "32k".
    "32k-none-host": "student --config configs/32k.py --docs 8 --steps 2 --memory --set "
                     "opt.state_memory=host",
    # ... which ran out of memory in JAX's pool (2026-12-05: its 88.89 GiB block of temporaries in
    # no piece; auto now tries the block first, remat_auto.one_piece). The same none with the pool
    # taken whole at the start: one region, no region boundaries to split the block. (2026-12-05,
    # 513b68b: it runs, 44.31 s, 106.9 GiB: no faster than dots_attention's 42.75 s with the moments
    # on the GPU; on the H100 at 8K none and dots_attention with host moments tie, 3.45 / 3.46 s.)
    "32k-none-host-prealloc": "student --config configs/32k.py --docs 8 --steps 2 --memory --set "
                              "opt.state_memory=host --set student.remat=none --preallocate",
    # ... and with CUDA's stream-ordered allocator (cudaMallocAsync: its own pool, grown by the
    # driver, not JAX's BFC regions).
    "32k-none-host-async": "student --config configs/32k.py --docs 8 --steps 2 --memory --set "
                           "opt.state_memory=host --set student.remat=none --set "
                           "mesh.allocator=cuda_async",
    "32k-accum4": "student --config configs/32k.py --docs 8 --accum 4",
    "32k-1doc": "student --config configs/32k.py --docs 1 --accum 4",
    # The 128K step's single 46 GiB block of temporaries needs that much free in one piece: more
    # than JAX's own 75% of the GPU leaves (the config's mesh.memory_fraction, 0.92, does).
    "128k": "student --config configs/128k.py --docs 16 --accum 1 --steps 4 --memory",
    # The policies auto chooses between at 128K: the block recomputed whole, or all but the
    # attention (its merged output and log-normalisers kept, ~0.76 GiB a layer).
    "128k-full": "student --config configs/128k.py --docs 16 --accum 1 --steps 4 --memory "
                 "--set student.remat=full",
    "128k-attention": "student --config configs/128k.py --docs 16 --accum 1 --steps 4 --memory "
                      "--set student.remat=attention",
    # 256K: XLA plans 112.67 GiB of temporaries + 18.15 of arguments with remat full and the
    # moments in host memory (`--steps 0`); in JAX's pool (BFC), even at 0.97 of the GPU, the
    # temporaries found no room in one piece (2026-12-03). With mesh.allocator=platform (no pool)
    # the step ran (2026-12-04: 193 s with its compile, then 20.0 s per step): allow ~5 min for
    # this entry. No plan compiled first (~170 s at 256K).
    # (configs/256k.py: remat full, moments on the host, mesh.allocator platform, 0.97.)
    "256k": "student --config configs/256k.py --docs 32 --accum 1 --steps 3",
    # The same with the block's projections in FP8 (configs/256k.py keeps bf16 until this is
    # measured: the target is >= 16k tokens/s within 135 GiB); "256k" is its baseline.
    "256k-fp8": "student --config configs/256k.py --docs 32 --accum 1 --steps 3 "
                "--set student.fp8_matmuls=True",
    # The same in JAX's pool taken whole (no cudaMalloc per buffer), now that host moments never
    # pass through the GPU (2026-12-05): faster than the platform allocator's 20.0 s? (2026-12-05,
    # 513b68b: compile and first step 282 s at 122.3 GiB, then the call's limit: give it ~6 min.)
    "256k-prealloc": "student --config configs/256k.py --docs 32 --accum 1 --steps 3 "
                     "--set mesh.allocator= --preallocate",
    # 2.1M tokens each, 8 regions (64 rows at 8K and 16 at 32K until 2026-12-03: two regions, so
    # the writes left after the last batch, one region's, weighed ~5% of the run; a real cache
    # of billions of tokens pays them once per split). write_cache logs that drain.
    "teacher-8k": "teacher --seq-len 8192 --docs 4 --rows 256",
    "teacher-32k": "teacher --seq-len 32768 --docs 8 --rows 64",
    # The teacher's projections in FP8 (teacher.fp8_matmuls; the lm_head, log-softmax and top-k
    # as in bf16): against "teacher-8k" / "teacher-gpt-oss-120b-8k" in the same call for the
    # ratio. Its fidelity on the real teacher: experiments/studies/fp8_teacher_fidelity.py.
    "teacher-8k-fp8": "teacher --seq-len 8192 --docs 4 --rows 256 --set teacher.fp8_matmuls=True",
    # Its step profiled (one more row traced after the step alone; the summary in the line): the
    # last profile (46ee74d) predates the top-k's rewrite, and 32K sits at the 36k target
    # (35.2-36.9k on different H200s, 2026-12-04/05).
    "teacher-32k-profile": "teacher --seq-len 32768 --docs 8 --rows 16 "
                           "--profile /tmp/kdjax_e2e/profile_teacher_32k",
    # The teacher's MLP is swiglu's kernel by default since 2026-12-06 (mlp_impl "auto": the gate
    # and up matmuls in one Mosaic GPU kernel, the gating in its epilogue; the 46ee74d profile's
    # SwiGLU fusion took 2.7% of the 32K step). The same runs with XLA's two GEMMs and a fusion,
    # for the ratio in one call; the kernel alone: experiments/bench/swiglu_bench.py.
    "teacher-8k-xla": "teacher --seq-len 8192 --docs 4 --rows 256 --set teacher.mlp_impl=xla",
    "teacher-32k-xla": "teacher --seq-len 32768 --docs 8 --rows 64 --set teacher.mlp_impl=xla",
    # The configs' cache layout is "dictionary" since 2026-12-04; the same runs
    # with the compact layout measured before, for the ratio in one call.
    "teacher-8k-compact": "teacher --seq-len 8192 --docs 4 --rows 256 --set cache.layout=compact",
    "teacher-32k-compact": "teacher --seq-len 32768 --docs 8 --rows 64 "
                           "--set cache.layout=compact",
    # Two GPUs (sweep 8k 8k-dp2 teacher-8k-b2 teacher-8k-fsdp2 teacher-70b-8k-fsdp2 in one call:
    # the ratios to one GPU). The same 32 rows per step as `8k`, 16 rows per GPU; the teacher
    # sharded over both (weights over fsdp, a batch's 2 rows one per GPU) against one GPU with
    # the same batch of 2; a Llama-3.1-70B-shaped teacher (141 GB of bf16 weights, more than one
    # H200 holds) built sharded over both.
    "8k-dp2": "student --config configs/8k.py --docs 4 --set mesh.data=2 --set opt.batch_size=2 "
              "--set opt.accum_steps=16",
    "teacher-8k-b2": "teacher --seq-len 8192 --docs 4 --rows 64 --set cache.batch_size=2",
    "teacher-8k-fsdp2": "teacher --seq-len 8192 --docs 4 --rows 64 --set cache.batch_size=2 "
                        "--set mesh.fsdp=2 --set opt.batch_size=2",
    "teacher-70b-8k-fsdp2": "teacher --seq-len 8192 --docs 4 --rows 8 --set cache.batch_size=2 "
                            "--set mesh.fsdp=2 --set opt.batch_size=2 --set teacher.d_model=8192 "
                            "--set teacher.n_layers=80 --set teacher.n_heads=64 "
                            "--set teacher.d_ff=28672 --mem-fraction 0.95",
    # gpt-oss (configs/gpt_oss.py): RANDOM MXFP4 teachers built on the GPU (the 120b's ~61 GB of
    # packed experts would not fit the disk beside a checkpoint), and the MoE student at 32K.
    # 8 rows of 8K per teacher call: the config's 64K tokens per call (2 rows of its 32K).
    "teacher-gpt-oss-20b-8k": "teacher --config configs/gpt_oss.py:20b --seq-len 8192 --docs 4 "
                              "--rows 32 --mem-fraction 0.9 --set cache.batch_size=8",
    "teacher-gpt-oss-120b-8k": "teacher --config configs/gpt_oss.py --seq-len 8192 --docs 4 "
                               "--rows 32 --mem-fraction 0.9 --set cache.batch_size=8",
    "teacher-gpt-oss-120b-8k-fp8": "teacher --config configs/gpt_oss.py --seq-len 8192 --docs 4 "
                                   "--rows 32 --mem-fraction 0.9 --set cache.batch_size=8 "
                                   "--set teacher.fp8_matmuls=True",
    "teacher-gpt-oss-120b-32k": "teacher --config configs/gpt_oss.py --seq-len 32768 --docs 8 "
                                "--rows 8 --mem-fraction 0.95",
    "gpt-oss-32k": "student --config configs/gpt_oss.py --docs 8 --steps 2 --memory "
                   "--mem-fraction 0.95",
}
