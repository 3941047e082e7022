"""LoRA adapters on an SGLang server: `SGLangSampler`'s adapter methods.

SGLang serves many adapters on one base (S-LoRA / Punica kernels; launched
with `--enable-lora --max-lora-rank R --lora-target-modules ...`, see
`scripts/launch_sglang.sh`). Its documented HTTP calls:

* `POST /load_lora_adapter {"lora_name", "lora_path"}`: loads a PEFT-format
  adapter directory (`models.io.peft_io.save_peft_adapter` writes one) under a
  name; answers `{"success", "error_message", "loaded_adapters"}` with 200, or
  400 when it failed (e.g. the name is taken).
* `POST /unload_lora_adapter {"lora_name"}`: the same answer shape.
* `POST /generate` with `"lora_path": "<name>"` samples with that adapter; a
  name that is not loaded is a 400 ("The following requested LoRA adapters
  are not loaded: ...").

The client sends `SamplingParams.adapter` as `lora_path`, and refuses a name
it did not load (ValueError naming `adapter`) before anything is sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx

from ac2_jax.sampling.base import check_adapter_name


class SGLangAdapters:
    """Mixin of `SGLangSampler`: the adapters it loaded into SGLang, by name."""

    base_url: str
    _http: Callable[[], httpx.Client]  # the sampler's synchronous client
    _adapters: dict[str, str]  # name -> the adapter directory SGLang loaded
    _adapter_lock: threading.Lock

    def adapters(self) -> list[str]:
        """The LoRA adapters this client loaded and SGLang serves (`SamplingParams.adapter`)."""
        with self._adapter_lock:
            return sorted(self._adapters)

    def load_adapter(self, name: str, path: str) -> None:
        """Loads the PEFT adapter directory `path` into SGLang as `name` (a path SGLang's
        process can read). ValueError with SGLang's message when it refuses."""
        check_adapter_name(name, "load_adapter: name")
        data = self._lora_call("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        with self._adapter_lock:
            self._adapters[name] = path
            self._sync(data)

    def remove_adapter(self, name: str) -> None:
        """Unloads adapter `name` from SGLang."""
        data = self._lora_call("/unload_lora_adapter", {"lora_name": name})
        with self._adapter_lock:
            self._adapters.pop(name, None)
            self._sync(data)

    def check_adapter(self, name: str | None) -> None:
        """ValueError naming `adapter` unless `name` is None or a loaded adapter."""
        if name is not None and name not in self.adapters():
            raise ValueError(
                f"SamplingParams.adapter: SGLang at {self.base_url} serves no adapter "
                f"{name!r} loaded by this client (it serves {self.adapters()}; "
                "load_adapter loads one)"
            )

    def _sync(self, data: dict[str, Any]) -> None:
        loaded = data.get("loaded_adapters")
        if isinstance(loaded, dict):  # the server's own list is the truth
            self._adapters = {k: self._adapters.get(k, str(v)) for k, v in loaded.items()}

    def _lora_call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self._http().post(route, json=body)  # the sampler's one client
        try:
            data = r.json()
        except ValueError:
            data = {"success": False, "error_message": r.text[:500]}
        if r.status_code != 200 or not data.get("success", False):
            raise ValueError(
                f"SGLang {route}({body}) failed: HTTP {r.status_code}: {data.get('error_message')}"
            )
        return data
