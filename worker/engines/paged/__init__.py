"""ortfleet's own engine on a paged KV cache (one pool of fixed-size blocks shared by every row, as the
paged CUDA model's `block_table` addresses it): the block manager. The scheduler, the session on the
paged graph and the wiring into the engine core come next."""
