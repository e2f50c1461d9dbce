"""attnopt.runtime: torch.library ops, strategies (one file per plan kind), Triton kernels, collectives."""
