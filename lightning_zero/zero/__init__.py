"""The ZeRO data path, one file per step of a parameter's life, read top to bottom:

``partition.py`` (pure layout arithmetic) -> ``build.py`` (model and optimizers into flat buffers;
``flat.py`` holds their tensors and states, ``host.py`` their host-memory tiers) -> ``gather.py``
(stage 3 module hooks) -> ``reduce.py`` (gradient buckets) -> ``step.py`` (the optimizer on this
rank's slices; ``step_kernels.py`` the compiled kernels it may use) -> ``publish.py`` (updated slices
back into whole parameters). ``engine.py`` owns them all and is the only surface other layers use.
"""
