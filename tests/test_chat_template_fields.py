"""vLLM's chat-template fields of a chat request: ``chat_template_kwargs`` (a
template's own variables, such as Qwen3's ``enable_thinking``),
``add_generation_prompt``, ``continue_final_message`` (the model continues
the last message: a prefilled answer) and ``documents``; on
``ChatTemplate.render`` and through the server (``/v1/chat/completions``
with the ``openai`` client's ``extra_body``, and ``/tokenize``), each misuse
a 400 naming its field."""

from __future__ import annotations

import openai
import pytest
import trio
from helpers.fakes import SERVING
from helpers.server import post_json, serving
from helpers.waiting import in_thread

from trioserve import InvalidRequestError
from trioserve.frontend.text.chat_template import ChatTemplate

pytestmark = pytest.mark.fake_config(**SERVING)

MODEL = "tiny-llama"
# Like a reasoning model's template: a thinking switch, documents, and each message closed by <end>.
TEMPLATE = (
    "{% for d in documents or [] %}DOC {{ d.title }}: {{ d.text }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}<end>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% if enable_thinking is false %}<nothink>{% endif %}{% endif %}"
)
QUESTION = [{"role": "user", "content": "Name a colour."}]
PREFILLED = [*QUESTION, {"role": "assistant", "content": "The colour is"}]


def test_variables_documents_and_the_generation_prompt_reach_the_template():
    template = ChatTemplate(TEMPLATE)
    assert template.render(QUESTION) == "user: Name a colour.<end>\nassistant: "
    assert template.render(QUESTION, variables={"enable_thinking": False}).endswith("assistant: <nothink>")
    assert template.render(QUESTION, add_generation_prompt=False) == "user: Name a colour.<end>\n"
    documents = [{"title": "Sky", "text": "It is blue."}]
    assert template.render(QUESTION, documents=documents).startswith("DOC Sky: It is blue.\nuser:")


def test_continue_final_message_leaves_the_last_message_open():
    template = ChatTemplate(TEMPLATE)
    text = template.render(PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert text == "user: Name a colour.<end>\nassistant: The colour is"
    # A template that strips the content: the stripped text is found.
    stripping = ChatTemplate("{% for m in messages %}[{{ m.content | trim }}]{% endfor %}")
    spaced = [{"role": "assistant", "content": "  The colour is  "}]
    assert stripping.render(spaced, add_generation_prompt=False, continue_final_message=True) == "[The colour is"


@pytest.mark.parametrize(
    ("source", "messages", "options", "field", "says"),
    [
        (TEMPLATE, PREFILLED, {"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        (
            "{% for m in messages %}{{ m.content | upper }}{% endfor %}",
            PREFILLED,
            {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
            "does not write the last message's text as it stands",
        ),
        (
            TEMPLATE,
            [*QUESTION, {"role": "assistant", "content": " "}],
            {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
            "no text to continue",
        ),
        (TEMPLATE, QUESTION, {"variables": {"messages": []}}, "chat_template_kwargs", "'messages' is set by"),
        (TEMPLATE, QUESTION, {"variables": {"bos_token": "<x>"}}, "chat_template_kwargs", "'bos_token' is set by"),
    ],
)
def test_each_misuse_is_refused_naming_its_field(source, messages, options, field, says):
    with pytest.raises(InvalidRequestError) as caught:
        ChatTemplate(source).render(messages, **options)
    assert caught.value.field == field and says in str(caught.value)


async def test_the_fields_through_the_server_and_the_openai_client(fake_config):
    with trio.fail_after(60):
        async with serving(fake_config(chat_template=TEMPLATE), model_name=MODEL) as server:

            def tokenized_text(**body: object) -> tuple[int, str]:
                status, answer = post_json(server, "/tokenize", {"model": MODEL, **body})
                assert status == 200, answer
                status, text = post_json(server, "/detokenize", {"model": MODEL, "tokens": answer["tokens"]})
                assert status == 200, text
                return answer["count"], text["prompt"]

            def calls() -> None:
                count, text = tokenized_text(messages=QUESTION, chat_template_kwargs={"enable_thinking": False})
                assert text.endswith("assistant: <nothink>")
                prefilled = {"messages": PREFILLED, "add_generation_prompt": False, "continue_final_message": True}
                prefilled_count, text = tokenized_text(**prefilled)
                assert text.endswith("assistant: The colour is")
                client = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=20)
                thinking_off = client.chat.completions.create(
                    model=MODEL,
                    messages=QUESTION,  # type: ignore[arg-type]
                    max_tokens=3,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                )
                assert thinking_off.usage is not None and thinking_off.usage.prompt_tokens == count
                continued = client.chat.completions.create(
                    model=MODEL,
                    messages=PREFILLED,  # type: ignore[arg-type]
                    max_tokens=3,
                    extra_body={"add_generation_prompt": False, "continue_final_message": True},
                )
                assert continued.usage is not None and continued.usage.prompt_tokens == prefilled_count
                with pytest.raises(openai.BadRequestError) as refused:
                    client.chat.completions.create(
                        model=MODEL,
                        messages=PREFILLED,  # type: ignore[arg-type]
                        max_tokens=3,
                        extra_body={"continue_final_message": True},
                    )
                assert refused.value.body["param"] == "continue_final_message"  # type: ignore[index]
                status, answer = post_json(
                    server,
                    "/v1/chat/completions",
                    {"model": MODEL, "messages": QUESTION, "chat_template_kwargs": {"tools": []}},
                )
                assert status == 400 and answer["error"]["param"] == "chat_template_kwargs", answer

            await in_thread(calls)
