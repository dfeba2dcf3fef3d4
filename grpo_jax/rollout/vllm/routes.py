"""The vLLM server's weight-sync routes as methods of `VLLMClient` (a mixin: they use its
`_request`, session, API key, retries and `weight_sync_timeout`).

The first four are vLLM's VLLMWeightSyncClient protocol (vllm.distributed.weight_transfer.base),
so vLLM's own trainer engines (nccl_sync) can drive the server through our client: vLLM's
HTTPVLLMWeightSyncClient sends no API key.
"""

from __future__ import annotations

import json

from grpo_jax.rollout.server.wire import RAW_UPDATE_ROUTE, UPDATE_INFO_HEADER


class WeightRoutes:
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._weight_route("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._weight_route("/start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._weight_route("/update_weights", {"update_info": update_info})

    def update_weights_raw(self, update_info: dict, data: bytes) -> None:
        """One grpo_http bucket through our route: `data` as the raw body (http_sync)."""
        self._request("POST", RAW_UPDATE_ROUTE, data, timeout=self.weight_sync_timeout,
                      headers={"content-type": "application/octet-stream",
                               UPDATE_INFO_HEADER: json.dumps(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._weight_route("/finish_weight_update", {"weight_version": weight_version})

    def _weight_route(self, path: str, body=None):
        return self._request("POST", path, body, timeout=self.weight_sync_timeout)

    def pause(self) -> None:
        """Stop scheduling once the requests in flight are done (they finish with the weights
        they started with), then drop the KV and prefix caches: every later request runs on the
        weights loaded before `resume`."""
        self._weight_route("/pause?mode=wait")

    def resume(self) -> None:
        self._weight_route("/resume")

    def weight_version(self) -> str:
        """The version named by the last /finish_weight_update; a fresh server says "default"."""
        return self._request("GET", "/weight_info", timeout=60)["weight_version"]

    def world_size(self) -> int:
        """The server's workers (TP x PP x DP): the NCCL group is these plus the trainer."""
        return int(self._request("GET", "/get_world_size", timeout=60)["world_size"])

    def set_weight_version(self, version: str) -> None:
        self._request("POST", "/update_weight_version", {"new_version": version})
