"""A host page pool laid out as SGLang's MLA host pool (``MLATokenToKVPoolHost``), for the backend tests.

SGLang's own pool cannot be built outside a full SGLang install (its module imports SGLang's model
configs, which need a torchvision built for the installed torch), so the tests use this one: the
same attributes and the same three page methods the storage path calls, over a real torch buffer in
either layout (``layer_first``: ``[layers, tokens, 1, row]``; ``page_first``: ``[tokens, layers, 1,
row]``). Pages are ``page_size`` consecutive token slots; a flat page is that slice flattened in
the buffer's order, as SGLang's generic (``batch_get``/``batch_set``) and ``interface_v1`` paths
hand it to the storage backend.
"""

from __future__ import annotations

import torch


class HostPages:
    def __init__(
        self,
        *,
        layer_num: int = 2,
        page_size: int = 16,
        pages: int = 8,
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        dtype: torch.dtype = torch.float32,
        layout: str = "layer_first",
    ):
        self.layer_num = layer_num
        self.page_size = page_size
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.dtype = dtype
        self.layout = layout
        self.size = pages * page_size
        if layout == "layer_first":
            shape = (layer_num, self.size, 1, self.kv_cache_dim)
        elif layout == "page_first":
            shape = (self.size, layer_num, 1, self.kv_cache_dim)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index : index + self.page_size]
        else:
            page = self.kv_buffer[index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.layer_num * self.page_size * self.kv_cache_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            shape = (self.layer_num, self.page_size, 1, self.kv_cache_dim)
            self.kv_buffer[:, index : index + self.page_size] = data_page.reshape(shape)
        else:
            shape = (self.page_size, self.layer_num, 1, self.kv_cache_dim)
            self.kv_buffer[index : index + self.page_size] = data_page.reshape(shape)

    def rows(self, index: int) -> torch.Tensor:
        """The page at token slot ``index`` as ``[layers, page_size, row]`` (for comparisons)."""
        if self.layout == "layer_first":
            return self.kv_buffer[:, index : index + self.page_size, 0]
        return self.kv_buffer[index : index + self.page_size, :, 0].transpose(0, 1)
