"""The user's data for the API, as the token blocks the stages take: text (a string or documents) or a 1-D token stream
packed into ``[n, seq_len]`` blocks with next-token targets (``data.datamodule.pack``, what the CLI trains and checks
on), or blocks given as a 2-D tensor.

Example::

    x, y = validation_blocks(val_text, tokenizer, seq_len=64, what="validation")   # [n, 64] each
    c = calibration_blocks(train_ids, tokenizer, seq_len=64, what="calibration")   # [m, 64]
"""

from __future__ import annotations

import torch

from qharness.errors import UserError

Data = str | list[str] | torch.Tensor


def token_stream(data: Data, tokenizer, what: str) -> torch.Tensor:
    """``data`` (text, documents or a 1-D token tensor) as one 1-D token stream (documents separated by EOS, as the
    CLI's token cache does)."""
    if isinstance(data, torch.Tensor):
        if data.dim() != 1 or data.dtype not in (torch.int32, torch.int64):
            raise UserError(
                f"{what} is a {data.dim()}-D {data.dtype} tensor",
                fix=f"pass {what} as text or a 1-D integer token tensor",
            )
        return data.to(torch.long).cpu()
    texts = [data] if isinstance(data, str) else data
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise UserError(
            f"{what} is a {type(data).__name__}", fix=f"pass {what} as a string, a list of strings or a token tensor"
        )
    if tokenizer is None:
        raise UserError(f"{what} is text but no tokenizer was given", fix="pass tokenizer= (the model's HF tokenizer)")
    from qharness.sources.text import tokenize_stream

    return tokenize_stream(texts, tokenizer)


def validation_blocks(
    data: Data, tokenizer, seq_len: int, what: str = "validation"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets ``[n, seq_len]``: from text or a 1-D stream, or a 2-D ``[n, seq_len + 1]`` tensor of
    blocks (inputs are its first ``seq_len`` columns, targets its last)."""
    if isinstance(data, torch.Tensor) and data.dim() == 2:
        if data.shape[1] != seq_len + 1:
            raise UserError(
                f"{what} blocks have shape {tuple(data.shape)}; they need seq_len + 1 = {seq_len + 1} columns "
                "(inputs and the next-token target of the last one)",
                fix=f"pass [n, {seq_len + 1}] token blocks, or the text or 1-D token stream to cut them from",
            )
        data = data.to(torch.long).cpu()
        return data[:, :-1], data[:, 1:]
    from qharness.data.datamodule import pack

    x, y = pack(token_stream(data, tokenizer, what), seq_len)
    if len(x) == 0:
        raise UserError(f"{what} holds less than one block of {seq_len + 1} tokens", fix=f"give more {what} text")
    return x, y


def calibration_blocks(data: Data, tokenizer, seq_len: int, what: str = "calibration") -> torch.Tensor:
    """``[m, seq_len]`` token blocks: the first ``calibration.blocks`` (32, the CLI's default) of text or a 1-D stream
    (packed), or a 2-D ``[m, seq_len]`` tensor as given (all of it: each block is one pass of the deploy graph)."""
    if isinstance(data, torch.Tensor) and data.dim() == 2:
        if data.shape[1] != seq_len or data.dtype not in (torch.int32, torch.int64):
            raise UserError(
                f"{what} blocks are a {data.dtype} tensor of shape {tuple(data.shape)}",
                fix=f"pass [m, {seq_len}] integer token blocks (the prepared seq_len), or text",
            )
        return data.to(torch.long).cpu()
    from qharness.config import CalibrationConfig

    return validation_blocks(data, tokenizer, seq_len, what)[0][: CalibrationConfig().blocks]
