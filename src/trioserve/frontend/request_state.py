"""One request as the front-end tracks it: its detokenizer and its mailbox."""

from __future__ import annotations

from trioserve.frontend.detokenizer import IncrementalDetokenizer
from trioserve.frontend.outputs import OutputCollector, RequestOutput
from trioserve.frontend.tokenizer import Tokenizer
from trioserve.messages import AddRequest, SamplingParams, TokenOutput


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        *,
        client_id: str = "",
    ) -> None:
        self.request_id = request_id
        self.client_id = client_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, stop=params.stop)
        self.collector = OutputCollector()
        self.num_output_tokens = 0
        self.finished = False

    def add_request(self) -> AddRequest:
        return AddRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            client_id=self.client_id,
        )

    def process(self, output: TokenOutput) -> bool:
        """Turn an engine output into a delta for the consumer. Returns True when
        a stop string ended the request here (the engine must be told)."""
        self.num_output_tokens += len(output.new_token_ids)
        update = self.detokenizer.update(output.new_token_ids)
        text = update.text_delta
        finish_reason = output.finish_reason
        stop_reason: str | int | None = None
        if update.stop_string is not None:
            finish_reason, stop_reason = "stop", update.stop_string
        elif finish_reason is not None:
            text += self.detokenizer.flush()
            last = output.new_token_ids[-1] if output.new_token_ids else None
            if finish_reason == "stop" and last in self.params.stop_token_ids:
                stop_reason = last
        self.finished = finish_reason is not None
        self.collector.put(
            RequestOutput(
                request_id=self.request_id,
                text=text,
                token_ids=list(output.new_token_ids),
                cumulative_text=self.detokenizer.text,
                num_prompt_tokens=len(self.prompt_token_ids),
                num_output_tokens=self.num_output_tokens,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                logprobs=output.new_logprobs,
            )
        )
        return update.stop_string is not None
