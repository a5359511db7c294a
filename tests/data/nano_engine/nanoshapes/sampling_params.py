from dataclasses import dataclass


@dataclass
class SamplingParams:
    max_tokens: int = 16
    ignore_eos: bool = False
