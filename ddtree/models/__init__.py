"""Model runtime: the target runner (packed tree verify, KV cache) and the DFlash drafter architecture."""
