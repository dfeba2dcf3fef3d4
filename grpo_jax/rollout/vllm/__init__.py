"""The vLLM client: runs in the trainer's processes, talks to a vLLM server over HTTP (and NCCL)."""
