"""vLLM's model list and the tokenizer the router detokenizes with (vLLM's model root unless
`--tokenizer` names one)."""
from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import tokenizers

from .errors import APIError
from .logprobs import TokenTexts


class Models:
    def __init__(self, vllm_url: str, tokenizer_path: str | None):
        self.vllm_url = vllm_url
        self.tokenizer: tokenizers.Tokenizer | None = (
            load_tokenizer(tokenizer_path) if tokenizer_path else None)
        self.texts: TokenTexts | None = (
            TokenTexts(self.tokenizer, clean_up_spaces(tokenizer_path)) if tokenizer_path else None)
        self.models: dict[str, dict] = {}
        self._models_at = 0.0
        self._special: tuple[tuple[str, ...], frozenset[int]] | None = None

    async def refresh(self, session: aiohttp.ClientSession, force: bool = False) -> None:
        if self.models and not force:
            return
        if force and time.monotonic() - self._models_at < 1.0:
            return
        try:
            async with session.get(f"{self.vllm_url}/v1/models",
                                   timeout=aiohttp.ClientTimeout(total=10)) as r:
                data = await r.json(content_type=None)
            models = {m["id"]: m for m in data["data"]}
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as e:
            raise APIError(503, f"vLLM at {self.vllm_url} is unreachable: "
                                f"{type(e).__name__}: {e}") from None
        self.models, self._models_at = models, time.monotonic()
        if self.tokenizer is None:
            root = next(iter(models.values())).get("root") or next(iter(models))
            try:
                self.tokenizer = load_tokenizer(root)
            except (OSError, Exception) as e:  # noqa: BLE001 - tokenizers raises Exception
                raise APIError(500, f"cannot load a tokenizer from vLLM's model root {root!r} "
                                    f"({e}); start the router with --tokenizer PATH") from None
            self.texts = TokenTexts(self.tokenizer, clean_up_spaces(root))

    async def resolve(self, session: aiohttp.ClientSession, name) -> tuple[str, dict]:
        """The model a request names (vLLM's first one when it names none) and vLLM's entry."""
        if name is not None and not isinstance(name, str):
            raise APIError(400, "'model' must be a string", param="model")
        await self.refresh(session)
        if name is None:
            name = next(iter(self.models))
        if name not in self.models:
            await self.refresh(session, force=True)
        if name not in self.models:
            raise APIError(404, f"The model `{name}` does not exist.", param="model")
        return name, self.models[name]

    def special_tokens(self) -> tuple[tuple[str, ...], frozenset[int]]:
        """The tokenizer's special tokens: their texts and their ids."""
        if self._special is None:
            added = self.tokenizer.get_added_tokens_decoder()
            self._special = (tuple(t.content for t in added.values() if t.special),
                             frozenset(i for i, t in added.items() if t.special))
        return self._special


def clean_up_spaces(path: str) -> bool:
    """transformers' clean_up_tokenization_spaces of the tokenizer (vLLM decodes with it)."""
    d = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with open(os.path.join(d, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("clean_up_tokenization_spaces", False))
    except (OSError, ValueError):
        return False


def load_tokenizer(path: str) -> tokenizers.Tokenizer:
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return tokenizers.Tokenizer.from_file(path)
