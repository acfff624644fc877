"""Chat templates: rendering and assistant masks agree with transformers' apply_chat_template."""

import json
import pickle
import random
import shutil

import pytest

from tests.conftest import REPO, TOKENIZER
from torchtitan.data import build_tokenizer
from torchtitan.data.chat_template import (
    _PLACEMENT_TRIES_BASE,
    _PLACEMENT_TRIES_PER_CONTENT,
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    _located_spans,
    _place_contents,
    _prefix_spans,
    assistant_token_mask,
)

TEMPLATES = REPO / "tests" / "data" / "chat_templates"

# A ChatML-like layout without generation blocks: masks come from locating the turns in the rendering.
PLAIN_TEMPLATE = (
    r"{{ bos_token }}{% for message in messages %}"
    r"{{ '<|im_start|>' ~ message['role'] ~ '\n' ~ message['content'] ~ eos_token ~ '\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The same layout with generation blocks written by hand around what should be trained: content and end of turn.
MARKED_TEMPLATE = (
    r"{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' ~ message['role'] ~ '\n' }}"
    r"{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] ~ eos_token }}"
    r"{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] ~ eos_token ~ '\n' }}{% endif %}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Turns ended by text, no special token: the trained span is the content alone, so it can end inside the
# bytes of a character.
TEXT_TEMPLATE = (
    r"{% for m in messages %}{{ m['role'] ~ ': ' ~ m['content'] ~ '\n\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}assistant: {% endif %}"
)
TEXT_MARKED_TEMPLATE = (
    r"{% for m in messages %}{{ m['role'] ~ ': ' }}{% if m['role'] == 'assistant' %}{% generation %}"
    r"{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ '\n\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}assistant: {% endif %}"
)

# Content pieces: words, whitespace runs and newlines (which merge with the header's newline into one
# token), multi-byte and combining characters, special-token and Jinja-looking strings.
PIECES = ["Hello", " world", "ing", "'s", " 123", ".", "!", " ", "  ", "\n", "\n\n", "\t", "é", "世界", "🙂",
          "👩\u200d💻", "e\u0301", "<|end_of_text|>", "<|user|>", "{{ x }}", "ok"]


def random_conversations(count: int = 20, seed: int = 1234) -> list[tuple[list[dict], bool]]:
    """(messages, add_generation_prompt): system prompts, multi-turn, repeated roles, empty contents."""
    rng = random.Random(seed)

    def content():
        return "" if rng.random() < 0.15 else "".join(rng.choices(PIECES, k=rng.randrange(1, 12)))

    conversations = []
    for _ in range(count):
        roles = ["system"] if rng.random() < 0.5 else []
        for _ in range(rng.randrange(1, 5)):
            roles += ["user", "assistant"] + (["assistant"] if rng.random() < 0.15 else [])
        if rng.random() < 0.3:
            roles.pop()  # ends with a user turn: the prompt for the next reply
        messages = [{"role": role, "content": content()} for role in roles]
        conversations.append((messages, roles[-1] != "assistant" and rng.random() < 0.7))
    return conversations


CONVERSATIONS = random_conversations()


@pytest.fixture(scope="module")
def hf_reference():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)


@pytest.fixture(scope="module")
def tokenizers():
    return {name: build_tokenizer(str(TOKENIZER), name) for name in ("tokenizer.json", "tokenizer.model")}


def test_shipped_template_matches_transformers(hf_reference, tokenizers):
    tokenizer = tokenizers["tokenizer.json"]
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE == hf_reference.chat_template
    template = ChatTemplate(tokenizer.chat_template)
    assert template.has_generation_markers
    all_masks = []
    for messages, add_generation_prompt in CONVERSATIONS:
        expected = hf_reference.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True,
            return_assistant_tokens_mask=True, return_dict=True,
        )
        ids, mask = assistant_token_mask(tokenizer, template, messages, add_generation_prompt=add_generation_prompt)
        assert ids == list(expected["input_ids"]), messages
        assert mask == list(expected["assistant_masks"]), messages
        text, _ = template.render(messages, add_generation_prompt, bos_token="<|begin_of_text|>",
                                  eos_token="<|end_of_text|>")
        assert text == hf_reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                        tokenize=False)
        # One BOS; every turn ends with the EOS, and each assistant turn's EOS is trained.
        assert ids[0] == tokenizer.bos_id and ids.count(tokenizer.bos_id) == 1 + text.count("<|begin_of_text|>", 1)
        eos_positions = [i for i, t in enumerate(ids) if t == tokenizer.eos_id]
        assert len(eos_positions) == len(messages) + sum(m["content"].count("<|end_of_text|>") for m in messages)
        all_masks += mask
    assert 0 < sum(all_masks) < len(all_masks)


def test_shipped_template_layout(tokenizers):
    tokenizer = tokenizers["tokenizer.json"]
    template = ChatTemplate(tokenizer.chat_template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    text, spans = template.render(messages, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    assert text == "<|begin_of_text|><|user|>\nhi<|end_of_text|><|assistant|>\n<|end_of_text|>"
    assert [text[s:e] for s, e in spans] == ["<|end_of_text|>"]
    ids, mask = assistant_token_mask(tokenizer, template, messages)
    assert [i for i, m in zip(ids, mask) if m] == [tokenizer.eos_id]  # an empty reply still learns to stop
    prompt, _ = template.render(messages[:1], add_generation_prompt=True, bos_token=tokenizer.bos_token,
                                eos_token=tokenizer.eos_token)
    assert prompt == "<|begin_of_text|><|user|>\nhi<|end_of_text|><|assistant|>\n"


def runs(ids, mask, tokenizer):
    """Decoded text of each maximal run of masked tokens."""
    found, current = [], []
    for token, masked in zip(ids + [None], mask + [0]):
        if masked:
            current.append(token)
        elif current:
            found.append(tokenizer.decode(current))
            current = []
    return found


def reference(hf_tokenizer, template, messages, add_generation_prompt=False):
    """transformers' (ids, assistant mask) for the conversation."""
    out = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                           add_generation_prompt=add_generation_prompt,
                                           return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


# Assistant text ending in characters our vocabulary splits into byte tokens (any non-ASCII one; a real vocabulary
# splits emoji and rare characters).
NON_ASCII = [
    [{"role": "assistant", "content": "猫"}],
    [{"role": "user", "content": "Translate: cat"}, {"role": "assistant", "content": "Katze – chat – 猫"},
     {"role": "user", "content": "And a face?"}, {"role": "assistant", "content": "Voilà 🙂"}],
    [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "Café?"},
     {"role": "assistant", "content": "Oui, un café crème 👩\u200d💻"}, {"role": "user", "content": "e\u0301"},
     {"role": "assistant", "content": "naïve e\u0301"}],
]


def test_masks_mark_every_token_overlapping_the_assistant_text(hf_reference, tokenizers):
    # transformers marks every token overlapping a span: all byte tokens of a character the span ends in (the
    # model learns to finish it). With generation blocks, and without them (the spans located in the rendering),
    # against the same template with the blocks written by hand; both tokenizer formats.
    for name, tokenizer in tokenizers.items():
        for plain, marked in ((TEXT_TEMPLATE, TEXT_MARKED_TEMPLATE), (PLAIN_TEMPLATE, MARKED_TEMPLATE)):
            for messages in NON_ASCII:
                expected = reference(hf_reference, marked, messages)
                assert assistant_token_mask(tokenizer, ChatTemplate(marked), messages) == expected, (name, messages)
                assert assistant_token_mask(tokenizer, ChatTemplate(plain), messages) == expected, (name, messages)
        ids, mask = assistant_token_mask(tokenizer, ChatTemplate(TEXT_MARKED_TEMPLATE), NON_ASCII[0])
        cat = tokenizer.encode("猫")
        assert len(cat) == 3 and ids[-4:-1] == cat and mask[-4:] == [1, 1, 1, 0], name


def test_template_without_markers_trains_what_generation_blocks_around_each_turn_would(hf_reference, tokenizers):
    plain, marked = ChatTemplate(PLAIN_TEMPLATE), ChatTemplate(MARKED_TEMPLATE)
    assert not plain.has_generation_markers and marked.has_generation_markers
    for name, tokenizer in tokenizers.items():
        for messages, add_generation_prompt in CONVERSATIONS:
            expected = reference(hf_reference, MARKED_TEMPLATE, messages, add_generation_prompt)
            ids, mask = assistant_token_mask(tokenizer, plain, messages, add_generation_prompt=add_generation_prompt)
            assert (ids, mask) == expected, (name, messages)  # the two templates render the same text
            variables = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
            assert nests_and_agrees(plain, messages, variables, tokenizer.special_tokens, add_generation_prompt)

    tokenizer, eos = tokenizers["tokenizer.json"], "<|end_of_text|>"
    by_hand = [
        ([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
         [f"It is 4.{eos}"]),
        ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Bye"},
          {"role": "assistant", "content": "Goodbye"}],
         [f"Hello there{eos}", f"Goodbye{eos}"]),
    ]
    for messages, assistant_texts in by_hand:
        ids, mask = assistant_token_mask(tokenizer, plain, messages)
        assert runs(ids, mask, tokenizer) == assistant_texts


# Special tokens of the published templates under test, added to our vocabulary (ids from 2048) in both formats;
# the tags Qwen3 writes as text are added tokens not marked special, as in its tokenizer.
EXTRA_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                 "<s>", "</s>", "[INST]", "[/INST]", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|startoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]
EXTRA_PLAIN = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MODEL_TOKENS = {"qwen3.jinja": (None, "<|im_end|>"), "phi3.jinja": ("<s>", "<|endoftext|>"),
                "mistral_style.jinja": ("<s>", "</s>"), "qwen2_5_style.jinja": (None, "<|im_end|>"),
                "llama3_1_style.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
                "gptoss.jinja": ("<|startoftext|>", "<|return|>")}  # (bos, eos) of each template's model


@pytest.fixture(scope="module")
def model_tokenizers(tmp_path_factory):
    """For each template of tests/data/chat_templates: our tokenizer in both formats and transformers' fast
    tokenizer, all built from local files."""
    import tokenizers as hf_tokenizers

    transformers = pytest.importorskip("transformers")
    base = hf_tokenizers.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    base.add_special_tokens([hf_tokenizers.AddedToken(t, special=True, normalized=False) for t in EXTRA_SPECIAL])
    base.add_tokens([hf_tokenizers.AddedToken(t, special=False, normalized=False) for t in EXTRA_PLAIN])
    added = {str(i): {"content": t.content, "special": t.special} for i, t in base.get_added_tokens_decoder().items()}
    built = {}
    for name, (bos, eos) in MODEL_TOKENS.items():
        folder = tmp_path_factory.mktemp(name.split(".")[0])
        base.save(str(folder / "tokenizer.json"))
        shutil.copy(TOKENIZER / "tokenizer.model", folder / "tokenizer.model")
        config = {"bos_token": bos, "eos_token": eos, "added_tokens_decoder": added}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        ours = [build_tokenizer(str(folder), file) for file in ("tokenizer.json", "tokenizer.model")]
        theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=bos,
                                                      eos_token=eos)
        built[name] = ours, theirs, (TEMPLATES / name).read_text()
    return built


def nests_and_agrees(template, messages, variables, special_tokens, add_generation_prompt=False):
    """Whether the conversation's prefix renders nest; where they do, locating its turns in the whole rendering must
    find the spans they give (the two methods train the same text)."""
    text, _ = template.render(messages, add_generation_prompt, **variables)
    spans = _prefix_spans(template, messages, text, variables, special_tokens)
    if spans is not None:
        assert _located_spans(template, messages, text, add_generation_prompt, variables, special_tokens) == spans
    return spans is not None


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **reasoning):
    return {"role": "assistant", "content": text, **reasoning}


THINK = "<think>\n{}\n</think>\n\n"
# Three hand-made conversations per template, and the text each trains: every assistant message's reasoning
# block (as the template renders it for that message), content and end-of-turn token.
PUBLISHED_CASES = {
    "qwen3.jinja": [
        ([{"role": "system", "content": "You are terse."}, user("Hi"), assistant("Hello there."),
          user("Name a cat breed."), assistant("Siamese 🐱")],
         ["Hello there.<|im_end|>", THINK.format("") + "Siamese 🐱<|im_end|>"]),
        # Reasoning under two of its names; Qwen3 drops it from turns before the last user message.
        ([user("2+2?"), assistant("4.", reasoning_content="Add."), user("And 3+3?"),
          assistant("6.", thinking="Add again.")],
         ["4.<|im_end|>", THINK.format("Add again.") + "6.<|im_end|>"]),
        ([user("Count in French, one per message."), assistant("un", reasoning="Start at 1."),
          assistant("deux", reasoning_content="Then 2."), assistant("trois ✓")],
         [THINK.format("Start at 1.") + "un<|im_end|>", THINK.format("Then 2.") + "deux<|im_end|>",
          THINK.format("") + "trois ✓<|im_end|>"]),
    ],
    "phi3.jinja": [
        ([user("Hi"), assistant("Hello!"), user("Bye"), assistant("Bye!")], ["Hello!<|end|>", "Bye!<|end|>"]),
        ([{"role": "system", "content": "Be kind."}, user("Bonjour"), assistant("Salut 😊"), user("Ça va?"),
          assistant("Très bien.")],
         ["Salut 😊<|end|>", "Très bien.<|end|>"]),
        ([user("Q1"), assistant("A1"), user("Q2"), assistant(""), user("Q3"), assistant("A3 – done")],
         ["A1<|end|>", "<|end|>", "A3 – done<|end|>"]),
    ],
    # gpt-oss's harmony format: a system message becomes the developer's instructions, replies go to the final
    # channel and reasoning to the analysis channel (kept in the last turn only), the last reply ends <|return|>.
    "gptoss.jinja": [
        ([{"role": "system", "content": "Be brief."}, user("Hi"), assistant("Salut.")],
         ["<|channel|>final<|message|>Salut.<|return|>"]),
        ([{"role": "developer", "content": "Answer in French."}, user("Hi"), assistant("Bonjour 👋")],
         ["<|channel|>final<|message|>Bonjour 👋<|return|>"]),
        ([user("2+2?"), assistant("4.", thinking="Add."), user("And 3+3?"), assistant("6.", thinking="Add again.")],
         ["<|channel|>final<|message|>4.<|end|>",
          "<|channel|>analysis<|message|>Add again.<|end|><|start|>assistant<|channel|>final<|message|>6.<|return|>"]),
    ],
    "mistral_style.jinja": [
        ([{"role": "system", "content": "Answer in one word."}, user("Capital of France?"), assistant("Paris")],
         ["Paris</s>"]),
        ([user("Hi"), assistant("Hello"), user("Bye"), assistant("Goodbye 👋")], ["Hello</s>", "Goodbye 👋</s>"]),
        # Ends with a user turn: the system text goes into it, after the trained turns.
        ([{"role": "system", "content": "Be brief."}, user("1+1?"), assistant("2"), user("2+2?"), assistant("4"),
          user("Merci")],
         ["2</s>", "4</s>"]),
    ],
}


@pytest.mark.parametrize("name", PUBLISHED_CASES)
def test_published_templates_train_each_turn_of_multi_turn_conversations(model_tokenizers, name):
    ours, theirs, source = model_tokenizers[name]
    for tokenizer in ours:  # tags the model writes as text are not special: an end of turn is
        assert "<|im_end|>" in tokenizer.special_tokens and not {"<think>", "</think>"} & tokenizer.special_tokens
        assert tokenizer.special_tokens is tokenizer.special_tokens  # read once, not per conversation
    template = ChatTemplate(source)
    assert not template.has_generation_markers
    nested = []
    for messages, trained in PUBLISHED_CASES[name]:
        expected_ids = list(theirs.apply_chat_template(messages, chat_template=source, return_dict=True)["input_ids"])
        for tokenizer in ours:
            ids, mask = assistant_token_mask(tokenizer, template, messages)
            assert ids == expected_ids
            assert runs(ids, mask, tokenizer) == trained, (type(tokenizer).__name__, messages)
        nested.append(nests_and_agrees(template, messages, {"bos_token": theirs.bos_token or "",
                                                            "eos_token": theirs.eos_token}, ours[0].special_tokens))
    assert not all(nested)  # cases that only locating in the whole rendering trains


def tool(text):
    return {"role": "tool", "content": text}


WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = '{"city": "Paris",\n "temp": 21}'  # a tool result with JSON and a newline (Llama's tojson escapes both)
PARTS = [{"type": "text", "text": "Bonjour"}, {"type": "text", "text": " !"}]


def calls_weather(**content):
    """An assistant turn calling a tool, with content "" or none."""
    return {"role": "assistant", "tool_calls": [WEATHER_CALL], **content}


# Conversations shaped as tool-using and multimodal data is (tool calls with empty or no content, list-of-parts
# content, tool results the template escapes, reasoning inside a single turn's content), and the text each trains.
SHAPE_CASES = {
    "qwen2_5_style.jinja": [
        ([user("Weather in Paris?"), calls_weather(content=""), tool(WEATHER), assistant("21 °C, sunny ☀")],
         [QWEN_CALL + "<|im_end|>", "21 °C, sunny ☀<|im_end|>"]),
        ([user("Weather in Paris?"), calls_weather(), tool(WEATHER), assistant("21 °C.")],
         [QWEN_CALL + "<|im_end|>", "21 °C.<|im_end|>"]),
        ([{"role": "system", "content": [{"type": "text", "text": "Be polite."}]}, user("Say hi in French."),
          {"role": "assistant", "content": PARTS}, user("Merci"), assistant("De rien.")],
         ["Bonjour !<|im_end|>", "De rien.<|im_end|>"]),
    ],
    "qwen3.jinja": [
        ([user("Weather in Paris?"), calls_weather(content=""), tool(WEATHER), assistant("21 °C.")],
         [QWEN_CALL + "<|im_end|>", THINK.format("") + "21 °C.<|im_end|>"]),
        ([user("Weather in Paris?"), calls_weather(), tool(WEATHER), assistant("21 °C.", reasoning_content="Read it.")],
         [QWEN_CALL + "<|im_end|>", THINK.format("Read it.") + "21 °C.<|im_end|>"]),
        # Reasoning written inside the content of a single turn (R1-distill data): Qwen3 takes it out.
        ([user("What is 17 * 3?"), assistant("<think>\n17 * 3 = 51.\n</think>\n\n51")],
         [THINK.format("17 * 3 = 51.") + "51<|im_end|>"]),
        # Qwen3 renders content that is not a string as empty: the turn it writes is trained all the same.
        ([user("Hi"), {"role": "assistant", "content": PARTS}, user("Again?"), assistant("Bonjour !")],
         ["<|im_end|>", THINK.format("") + "Bonjour !<|im_end|>"]),
    ],
    "llama3_1_style.jinja": [
        ([{"role": "system", "content": "Use tools."}, user("Weather in Paris?"), calls_weather(), tool(WEATHER),
          assistant("It is 21 °C.")],
         ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is 21 °C.<|eot_id|>"]),
        ([user("Weather?"), calls_weather(content=""), tool("line 1\nline \"2\""), assistant("  Two lines.\n")],
         ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "Two lines.<|eot_id|>"]),
    ],
}


@pytest.mark.parametrize("name", SHAPE_CASES)
def test_tool_calls_list_content_escaped_tool_results_and_inline_reasoning_train(model_tokenizers, name):
    ours, theirs, source = model_tokenizers[name]
    template = ChatTemplate(source)
    variables = {"bos_token": theirs.bos_token or "", "eos_token": theirs.eos_token}
    for messages, trained in SHAPE_CASES[name]:
        expected_ids = list(theirs.apply_chat_template(messages, chat_template=source, return_dict=True)["input_ids"])
        for tokenizer in ours:
            ids, mask = assistant_token_mask(tokenizer, template, messages)
            assert ids == expected_ids
            assert runs(ids, mask, tokenizer) == trained, (type(tokenizer).__name__, messages)
        # Reasoning taken out of a content only the prefix renders can follow.
        if not any("</think>" in str(m.get("content")) for m in messages):
            nests_and_agrees(template, messages, variables, ours[0].special_tokens)


def test_placing_contents_is_bounded_in_tries_and_takes_one_per_verbatim_content():
    tried = []

    class Counted(str):  # counts the candidate readings tested
        def __contains__(self, part):
            tried.append(part)
            return str.__contains__(self, part)

    # Each content can be read as any run of a's and none fits the end, so readings multiply without a bound.
    values = [Counted("a" * 30)] * 12
    assert _place_contents("<" + "a" * 200 + ">", ["<"] + [""] * 11 + [">!"], values) is None
    assert 0 < len(tried) <= _PLACEMENT_TRIES_BASE + _PLACEMENT_TRIES_PER_CONTENT * len(values)
    tried.clear()
    values = [Counted("hello |"), Counted("world")]
    assert _place_contents("<hello ||world>", ["<", "|", ">"], values) == [(1, 8), (9, 14)]
    assert tried == ["hello |", "world"]


REASONING_CASES = [  # an assistant message's reasoning fields -> (thinking, reasoning_content) templates see
    ({"reasoning_content": "R"}, ("R", "R")),
    ({"thinking": "T"}, ("T", "T")),
    ({"reasoning": "X"}, ("X", "X")),
    ({"reasoning_content": "R", "thinking": "T"}, ("T", "R")),  # a thinking of its own is kept
    ({"reasoning_content": "R", "reasoning": "X"}, ("R", "R")),
    ({"thinking": "T", "reasoning": "X"}, ("T", "T")),
    ({"reasoning_content": "R", "thinking": "T", "reasoning": "X"}, ("T", "R")),
    ({"reasoning_content": None, "thinking": "T"}, ("T", "T")),  # unset: the next name counts
    ({"reasoning_content": "", "reasoning": "X"}, ("", "")),  # empty is set
    ({}, ("-", "-")),
]
READS_THINKING = "{% for m in messages %}{{ m.role }}[{{ m.thinking if m.thinking is defined else '-' }}]" \
                 "{{ m.content }}\n{% endfor %}"
READS_REASONING_CONTENT = READS_THINKING.replace("m.thinking", "m.reasoning_content")
READS_EVERYTHING = "{{ messages | tojson }}"  # key order too


def test_reasoning_fields_reach_templates_as_in_transformers(hf_reference):
    for fields, (thinking, reasoning_content) in REASONING_CASES:
        messages = [user("Why?"), assistant("Because.", **fields)]
        for source, seen in ((READS_THINKING, thinking), (READS_REASONING_CONTENT, reasoning_content)):
            text, _ = ChatTemplate(source).render(messages)
            assert text == f"user[-]Why?\nassistant[{seen}]Because.\n", fields
            assert text == hf_reference.apply_chat_template(messages, chat_template=source, tokenize=False), fields
        text, _ = ChatTemplate(READS_EVERYTHING).render(messages)
        assert text == hf_reference.apply_chat_template(messages, chat_template=READS_EVERYTHING, tokenize=False)
    # The example of the issue: Qwen3 reads reasoning_content, the data says thinking.
    qwen3 = (TEMPLATES / "qwen3.jinja").read_text()
    messages = [user("Why?"), assistant("A", thinking="Because.")]
    text, _ = ChatTemplate(qwen3).render(messages)
    assert "<think>\nBecause.\n</think>\n\nA<|im_end|>" in text
    assert text == hf_reference.apply_chat_template(messages, chat_template=qwen3, tokenize=False)


def test_tiktoken_path_matches_hf_path(tokenizers):
    hf, fast = tokenizers["tokenizer.json"], tokenizers["tokenizer.model"]
    assert fast.chat_template == hf.chat_template == DEFAULT_CHAT_TEMPLATE
    extra = ["a\u0301\u0301 👩\u200d💻 \U0001f600x é" * 3, "", "<|pad|><|end_of_text|>𝔘𝔫𝔦"]
    for source in (DEFAULT_CHAT_TEMPLATE, PLAIN_TEMPLATE):
        template = ChatTemplate(source)
        for messages, add_generation_prompt in CONVERSATIONS:
            text, _ = template.render(messages, add_generation_prompt, bos_token=hf.bos_token, eos_token=hf.eos_token)
            assert fast.encode_chat(text) == hf.encode_chat(text)  # ids and offsets
            assert assistant_token_mask(fast, template, messages, add_generation_prompt) == assistant_token_mask(
                hf, template, messages, add_generation_prompt)
    for text in extra:
        assert fast.encode_chat(text) == hf.encode_chat(text)
        offsets = fast.encode_chat(text)[1]
        assert (offsets[-1][1] if offsets else 0) == len(text)


def test_encode_chat_keeps_encode_unchanged(tokenizers):
    for tokenizer in tokenizers.values():
        text = "a<|end_of_text|>b"
        ids, offsets = tokenizer.encode_chat(text)
        assert ids[1] == tokenizer.eos_id and offsets[1] == (1, 16)
        assert tokenizer.eos_id not in tokenizer.encode(text)  # plain encode still treats it as text
        copy = pickle.loads(pickle.dumps(tokenizer))
        assert copy.encode_chat(text) == (ids, offsets) and copy.encode(text) == tokenizer.encode(text)


def test_chat_template_is_none_without_the_config_key(tmp_path):
    shutil.copy(TOKENIZER / "tokenizer.json", tmp_path / "tokenizer.json")
    assert build_tokenizer(str(tmp_path)).chat_template is None


def test_jinja_environment_matches_transformers(hf_reference):
    # tojson's defaults and options, loop controls, strftime_now, dropped None values, extra variables.
    source = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}|"
        "{{ m | tojson(indent=2, sort_keys=true) }}|{{ m | tojson(separators=(',', ':')) }}\n{% endfor %}"
        "{{ strftime_now('%Y') }} {{ tools is none }} {{ custom }} {{ eos_token }}"
    )
    messages = [{"role": "user", "content": "<é> & 'x' 🙂", "name": None}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    text, spans = ChatTemplate(source).render(messages, custom="extra", eos_token="<|end_of_text|>")
    assert spans == []
    assert text == hf_reference.apply_chat_template(messages, chat_template=source, tokenize=False, custom="extra")
    assert '"<é> & \'x\' 🙂"' in text and "name" not in text
    template = pickle.loads(pickle.dumps(ChatTemplate(source)))
    assert template.render(messages, custom="extra", eos_token="<|end_of_text|>") == (text, [])


def test_errors_are_one_line_chat_template_errors(tokenizers):
    tokenizer = tokenizers["tokenizer.json"]
    shipped = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="unknown chat role 'tool'"):
        assistant_token_mask(tokenizer, shipped, [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])
    with pytest.raises(ChatTemplateError, match="syntax error at line 2") as error:
        ChatTemplate("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    assert "\n" not in str(error.value)
    with pytest.raises(ChatTemplateError, match="failed to render: .*not_a_function") as error:
        ChatTemplate("{{ not_a_function() }}").render([])
    assert "\n" not in str(error.value)
    # Ends differently when the conversation goes on, so prefix renders do not nest: located all the same.
    trailing = ("{% for m in messages %}{{ m['role'] ~ ': ' ~ m['content'] ~ '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% else %}END{% endif %}")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    ids, mask = assistant_token_mask(tokenizer, ChatTemplate(trailing), messages)
    assert runs(ids, mask, tokenizer) == [" b"]  # the token " b" overlaps the span "b": it is marked

    # What cannot be located is refused in one line: reasoning written inside a content where the renders do not
    # nest (Qwen3 takes it out of the last turn only), content rendered twice, a turn without text content whose
    # start or end cannot be told.
    qwen3 = ChatTemplate((TEMPLATES / "qwen3.jinja").read_text())
    twice = ChatTemplate(trailing.replace("m['content'] ~", "m['content'] ~ '|' ~ m['content'] ~"))
    mistral = ChatTemplate((TEMPLATES / "mistral_style.jinja").read_text())
    unlocatable = [
        (qwen3, [user("q"), assistant("a"), user("r"), assistant("<think>r</think>b")],
         "cannot locate the assistant's text: .* reasoning written inside a content that the template moves out"),
        (twice, messages, "message 1 \\(assistant\\): cannot locate its text: the chat template renders its content 2"),
        (ChatTemplate(trailing), [user("q"), {"role": "assistant", "content": None}, user("r")],
         "message 1 \\(assistant\\): cannot locate its turn: it has no text content, and no special token ends"),
        (mistral, [{"role": "system", "content": "s"}, user("q"), assistant("")],
         ("message 2 \\(assistant\\): cannot locate its turn: it has no text content, and the conversation before "
          "it renders differently on its own")),
    ]
    for template, conversation, message in unlocatable:
        with pytest.raises(ChatTemplateError, match=message) as error:
            assistant_token_mask(tokenizer, template, conversation)
        assert "\n" not in str(error.value)
