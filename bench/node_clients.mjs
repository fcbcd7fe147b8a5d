// The JavaScript/TypeScript client libraries' calls, as their users write them, for bench/node_clients.py.
//
//   node bench/node_clients.mjs --list           prints {library: [call, ...]}
//   node bench/node_clients.mjs LIBRARY CALL     runs one call, prints {"passed": true, "detail"} or
//                                                {"passed": false, "error", "where"}
// The servers' URLs and the shared constants (models, prompts, the Person and the tool result) come as JSON in
// NODE_CLIENTS_CONFIG (bench/node_clients.py writes them from bench/python_clients.py). The libraries are
// loaded from NODE_CLIENTS_PREFIX (default /tmp/node-clients, see node_clients.py for the install command),
// never from the repository.
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';

const PREFIX = process.env.NODE_CLIENTS_PREFIX ?? '/tmp/node-clients';
const resolveFrom = createRequire(`${PREFIX}/node_modules/`);
const C = JSON.parse(process.env.NODE_CLIENTS_CONFIG ?? '{}');

// ESM resolves packages from the script's folder, so each library is resolved from PREFIX by name instead
async function load(name) {
  return import(pathToFileURL(resolveFrom.resolve(name)).href);
}

function expect(ok, detail) {
  const text = JSON.stringify(detail) ?? String(detail);
  if (!ok) throw new Error(`unexpected: ${text}`.slice(0, 500));
  return text.slice(0, 300);
}

const equal = (a, b) => JSON.stringify(a) === JSON.stringify(b);

// `count` distinct vectors of one length, each of length 1 (the OpenAI and /api/embed routes normalize them)
function unitVectors(vectors, count) {
  const norms = vectors.map((v) => Math.sqrt(v.reduce((s, x) => s + x * x, 0)));
  const ok = vectors.length === count && vectors.every((v) => v.length === vectors[0].length && v.length > 0)
    && norms.every((n) => Math.abs(n - 1) < 1e-4) && new Set(vectors.map((v) => v.join(','))).size === count;
  return expect(ok, { count: vectors.length, lengths: vectors.map((v) => v.length), norms });
}

async function personSchema() {
  const { z } = await load('zod');
  return z.object({ name: z.string(), age: z.number().int() }).describe('A person.');
}

async function weatherArgs() {
  const { z } = await load('zod');
  return z.object({ city: z.string() });
}

// ---------------------------------------------------------------- openai (openai-node)

function openaiCalls() {
  const client = async (base) => {
    const { default: OpenAI } = await load('openai');
    return new OpenAI({ baseURL: `${base}/v1`, apiKey: 'unused' });
  };
  const demo = () => client(C.demo);
  const scripted = () => client(C.scripted);

  async function toolsRoundTrip(streamed) {
    const openai = await scripted();
    const messages = [...C.weather_ask];
    const body = { model: C.scripted_model, messages, tools: [C.weather_tool] };
    const first = streamed
      ? await openai.chat.completions.stream(body).finalChatCompletion()
      : await openai.chat.completions.create(body);
    const call = first.choices[0].message.tool_calls?.[0];
    expect(call?.function.name === 'get_weather' && equal(JSON.parse(call.function.arguments), { city: 'Paris' }),
      first.choices[0]);
    messages.push(first.choices[0].message, { role: 'tool', tool_call_id: call.id, content: C.tool_result });
    const second = await openai.chat.completions.create({ ...body, messages });
    return expect(second.choices[0].message.content.includes(C.tool_result), second.choices[0].message);
  }

  return {
    'chat.completions.create': async () => {
      const out = await (await demo()).chat.completions.create(
        { model: C.demo_model, messages: C.ask, max_tokens: C.n, temperature: 0 });
      return expect(Boolean(out.choices[0].message.content) && out.usage.completion_tokens > 0, out);
    },
    'chat.completions.create stream, include_usage': async () => {
      const stream = await (await demo()).chat.completions.create({
        model: C.demo_model, messages: C.ask, max_tokens: C.n, temperature: 0, stream: true,
        stream_options: { include_usage: true } });
      let text = '';
      let usage = null;
      for await (const chunk of stream) {
        text += chunk.choices[0]?.delta?.content ?? '';
        if (chunk.usage) usage = { usage: chunk.usage, choices: chunk.choices.length };
      }
      return expect(Boolean(text) && usage?.usage.completion_tokens > 0 && usage.choices === 0, { text, usage });
    },
    'tools round trip': () => toolsRoundTrip(false),
    'tools round trip, chat.completions.stream': () => toolsRoundTrip(true),
    'chat.completions.parse zodResponseFormat': async () => {
      const { zodResponseFormat } = await load('openai/helpers/zod');
      const out = await (await scripted()).chat.completions.parse({
        model: C.scripted_model, messages: C.ask, response_format: zodResponseFormat(await personSchema(), 'person') });
      return expect(equal(out.choices[0].message.parsed, C.person), out.choices[0].message);
    },
    'chat.completions.parse zodFunction tool': async () => {
      const { zodFunction } = await load('openai/helpers/zod');
      const out = await (await scripted()).chat.completions.parse({
        model: C.scripted_model, messages: C.ask,
        tools: [zodFunction({ name: 'Person', parameters: await personSchema() })] });
      const call = out.choices[0].message.tool_calls?.[0];
      return expect(equal(call?.function.parsed_arguments, C.person), out.choices[0].message);
    },
    'chat.completions.runTools': async () => {
      const runner = (await scripted()).chat.completions.runTools({
        model: C.scripted_model, messages: C.weather_ask,
        tools: [{ type: 'function', function: { ...C.weather_tool.function, parse: JSON.parse,
          function: (args) => (args.city === 'Paris' ? C.tool_result : 'wrong city') } }] });
      const content = await runner.finalContent();
      return expect(content?.includes(C.tool_result), content);
    },
    'chat.completions.runTools stream': async () => {
      const runner = (await scripted()).chat.completions.runTools({
        model: C.scripted_model, messages: C.weather_ask, stream: true,
        tools: [{ type: 'function', function: { ...C.weather_tool.function, parse: JSON.parse,
          function: (args) => (args.city === 'Paris' ? C.tool_result : 'wrong city') } }] });
      let text = '';
      runner.on('content', (delta) => { text += delta; });
      const content = await runner.finalContent();
      return expect(content?.includes(C.tool_result) && text === content, { content, text });
    },
    'responses.create': async () => {
      const out = await (await demo()).responses.create(
        { model: C.demo_model, input: C.ask[0].content, max_output_tokens: C.n, temperature: 0 });
      return expect(Boolean(out.output_text) && out.status === 'completed', out.output_text);
    },
    'responses.create stream': async () => {
      const stream = await (await demo()).responses.create(
        { model: C.demo_model, input: C.ask, max_output_tokens: C.n, temperature: 0, stream: true });
      let text = '';
      let done = null;
      for await (const event of stream) {
        if (event.type === 'response.output_text.delta') text += event.delta;
        if (event.type === 'response.completed') done = event.response;
      }
      // output_text is the SDK's convenience on whole responses; the completed event carries the output items
      const final = done?.output.flatMap((item) => item.content ?? []).map((part) => part.text).join('');
      return expect(Boolean(text) && final === text, { text, final });
    },
    'responses.stream finalResponse': async () => {
      const stream = (await demo()).responses.stream(
        { model: C.demo_model, input: C.ask, max_output_tokens: C.n, temperature: 0 });
      let text = '';
      stream.on('response.output_text.delta', (event) => { text += event.delta; });
      const final = await stream.finalResponse();
      return expect(Boolean(text) && final.output_text === text, { text, final: final.output_text });
    },
    'responses.create tools round trip': async () => {
      const openai = await scripted();
      const { name, description, parameters } = C.weather_tool.function;
      const tools = [{ type: 'function', name, description, parameters, strict: false }];
      const first = await openai.responses.create({ model: C.scripted_model, input: C.weather_ask, tools });
      const call = first.output.find((item) => item.type === 'function_call');
      expect(call?.name === 'get_weather' && equal(JSON.parse(call.arguments), { city: 'Paris' }), first.output);
      const second = await openai.responses.create({ model: C.scripted_model, tools, input: [
        ...C.weather_ask, ...first.output, { type: 'function_call_output', call_id: call.call_id, output: C.tool_result }] });
      return expect(second.output_text.includes(C.tool_result), second.output);
    },
    'responses.parse zodTextFormat': async () => {
      const { zodTextFormat } = await load('openai/helpers/zod');
      const out = await (await scripted()).responses.parse({
        model: C.scripted_model, input: C.ask, text: { format: zodTextFormat(await personSchema(), 'person') } });
      return expect(equal(out.output_parsed, C.person), out.output_text);
    },
    'responses.create previous_response_id': async () => {
      const openai = await demo();
      const first = await openai.responses.create(
        { model: C.demo_model, input: C.ask, max_output_tokens: C.n, temperature: 0 });
      const second = await openai.responses.create({ model: C.demo_model, previous_response_id: first.id,
        input: 'Again, please.', max_output_tokens: C.n, temperature: 0 });
      return expect(Boolean(second.output_text) && second.previous_response_id === first.id, second.output_text);
    },
    'chat.completions.create json_object': async () => {
      const out = await (await scripted()).chat.completions.create(
        { model: C.scripted_model, messages: C.ask, response_format: { type: 'json_object' } });
      return expect(equal(JSON.parse(out.choices[0].message.content), C.person), out.choices[0].message);
    },
    'error: unknown model is NotFoundError': async () => {
      const { NotFoundError } = await load('openai');
      const e = await (await demo()).chat.completions.create({ model: 'no-such-model', messages: C.ask })
        .then(() => null, (err) => err);
      return expect(e instanceof NotFoundError && e.code === 'model_not_found' && e.message.includes('no-such-model'),
        { name: e?.name, status: e?.status, code: e?.code, message: e?.message });
    },
    'error: bad max_tokens is BadRequestError': async () => {
      const { BadRequestError } = await load('openai');
      const e = await (await demo()).chat.completions.create({ model: C.demo_model, messages: C.ask, max_tokens: -1 })
        .then(() => null, (err) => err);
      return expect(e instanceof BadRequestError && Boolean(e.error?.message),
        { name: e?.name, status: e?.status, error: e?.error });
    },
    'models.list': async () => {
      const ids = [];
      for await (const model of (await demo()).models.list()) ids.push(model.id);
      return expect(ids.includes(C.demo_model), ids);
    },
    'completions.create stream': async () => {
      let text = '';
      for await (const chunk of await (await demo()).completions.create(
        { model: C.demo_model, prompt: 'Once upon a time', max_tokens: C.n, temperature: 0, stream: true })) {
        text += chunk.choices[0]?.text ?? '';
      }
      return expect(Boolean(text), text);
    },
    'embeddings.create (base64 by default)': async () => {
      const out = await (await demo()).embeddings.create({ model: C.demo_model, input: C.texts });
      return unitVectors(out.data.map((row) => row.embedding), C.texts.length);
    },
    'embeddings.create float': async () => {
      const out = await (await demo()).embeddings.create(
        { model: C.demo_model, input: C.texts[0], encoding_format: 'float' });
      return unitVectors(out.data.map((row) => row.embedding), 1);
    },
  };
}

// ---------------------------------------------------------------- Vercel AI SDK (ai + providers)

// each provider as its docs set it up for a local server: [chat model, embedding model] factories
const AI_PROVIDERS = {
  '@ai-sdk/openai responses': async (base, model) => {
    const { createOpenAI } = await load('@ai-sdk/openai');
    const p = createOpenAI({ baseURL: `${base}/v1`, apiKey: 'unused' });
    return [p(model), p.embedding(model)];
  },
  '@ai-sdk/openai chat': async (base, model) => {
    const { createOpenAI } = await load('@ai-sdk/openai');
    const p = createOpenAI({ baseURL: `${base}/v1`, apiKey: 'unused' });
    return [p.chat(model), p.embedding(model)];
  },
  '@ai-sdk/openai-compatible': async (base, model) => {
    const { createOpenAICompatible } = await load('@ai-sdk/openai-compatible');
    // it asks for usage in streams (stream_options.include_usage) only when told to, as OpenAI and vLLM answer
    const p = createOpenAICompatible({ name: 'moe-serve', baseURL: `${base}/v1`, apiKey: 'unused', includeUsage: true });
    return [p(model), p.embeddingModel(model)];
  },
  // its default asks json_object with the schema in the prompt (and warns); this server decodes json_schema
  '@ai-sdk/openai-compatible supportsStructuredOutputs': async (base, model) => {
    const { createOpenAICompatible } = await load('@ai-sdk/openai-compatible');
    const p = createOpenAICompatible({ name: 'moe-serve', baseURL: `${base}/v1`, apiKey: 'unused', includeUsage: true,
      supportsStructuredOutputs: true });
    return [p(model), p.embeddingModel(model)];
  },
  'ollama-ai-provider-v2': async (base, model) => {
    const { createOllama } = await load('ollama-ai-provider-v2');
    const p = createOllama({ baseURL: `${base}/api` });
    return [p(model), p.embedding(model)];
  },
};

function aiCalls() {
  const calls = {};
  for (const [provider, make] of Object.entries(AI_PROVIDERS)) {
    const demo = async () => (await make(C.demo, C.demo_model));
    const scripted = async () => (await make(C.scripted, C.scripted_model))[0];
    calls[`${provider} generateText`] = async () => {
      const { generateText } = await load('ai');
      const out = await generateText(
        { model: (await demo())[0], prompt: C.ask[0].content, maxOutputTokens: C.n, temperature: 0 });
      return expect(Boolean(out.text) && out.usage.outputTokens > 0, { text: out.text, usage: out.usage });
    };
    calls[`${provider} streamText`] = async () => {
      const { streamText } = await load('ai');
      const out = streamText({ model: (await demo())[0], messages: C.ask, maxOutputTokens: C.n, temperature: 0,
        onError: ({ error }) => { throw error; } });
      let text = '';
      for await (const piece of out.textStream) text += piece;
      const usage = await out.usage;
      return expect(Boolean(text) && usage.outputTokens > 0, { text, usage });
    };
    calls[`${provider} tool execute, stopWhen stepCountIs(3)`] = async () => {
      const { generateText, tool, stepCountIs } = await load('ai');
      const getWeather = tool({ description: 'The weather in a city', inputSchema: await weatherArgs(),
        execute: async ({ city }) => (city === 'Paris' ? C.tool_result : 'wrong city') });
      const out = await generateText({ model: await scripted(), prompt: C.weather_ask[0].content,
        tools: { get_weather: getWeather }, stopWhen: stepCountIs(3) });
      return expect(out.text.includes(C.tool_result) && out.steps.length === 2,
        { text: out.text, steps: out.steps.map((s) => s.finishReason) });
    };
    if (provider === 'ollama-ai-provider-v2') {
      // it sends maxOutputTokens and temperature at the top of the body, where Ollama (and moe-serve) ignore
      // them; Ollama's own options reach the model
      calls[`${provider} generateText providerOptions.ollama.options`] = async () => {
        const { generateText } = await load('ai');
        const out = await generateText({ model: (await demo())[0], prompt: C.ask[0].content,
          providerOptions: { ollama: { options: { num_predict: 4, temperature: 0 } } } });
        return expect(out.usage.outputTokens === 4, { text: out.text, usage: out.usage });
      };
    }
    calls[`error: ${provider} unknown model is APICallError`] = async () => {
      const { generateText, APICallError } = await load('ai');
      const [model] = await make(C.demo, 'no-such-model');
      const e = await generateText({ model, prompt: 'Hi', maxRetries: 0 }).then(() => null, (err) => err);
      // ollama-ai-provider-v2 reads only OpenAI's error shape, not Ollama's {"error": "..."}: its message is the
      // status text, the server's words are in responseBody (so with Ollama itself too)
      const said = provider === 'ollama-ai-provider-v2' ? e?.responseBody : e?.message;
      return expect(APICallError.isInstance(e) && e.statusCode === 404 && said?.includes('no-such-model')
        && !e.isRetryable, { name: e?.name, status: e?.statusCode, message: e?.message });
    };
    calls[`${provider} streamText tool execute, stopWhen stepCountIs(3)`] = async () => {
      const { streamText, tool, stepCountIs } = await load('ai');
      const getWeather = tool({ description: 'The weather in a city', inputSchema: await weatherArgs(),
        execute: async ({ city }) => (city === 'Paris' ? C.tool_result : 'wrong city') });
      const out = streamText({ model: await scripted(), prompt: C.weather_ask[0].content,
        tools: { get_weather: getWeather }, stopWhen: stepCountIs(3), onError: ({ error }) => { throw error; } });
      const parts = [];
      for await (const part of out.fullStream) parts.push(part.type);
      const text = await out.text;
      const steps = (await out.steps).map((s) => s.finishReason);
      return expect(text.includes(C.tool_result) && equal(steps, ['tool-calls', 'stop']) && parts.includes('tool-result'),
        { text, steps, parts: [...new Set(parts)] });
    };
    calls[`${provider} generateObject`] = async () => {
      const { generateObject } = await load('ai');
      const out = await generateObject({ model: await scripted(), schema: await personSchema(), prompt: C.ask[0].content });
      return expect(equal(out.object, C.person), out.object);
    };
    calls[`${provider} streamText Output.object`] = async () => {
      const { streamText, Output } = await load('ai');
      const out = streamText({ model: await scripted(), output: Output.object({ schema: await personSchema() }),
        prompt: C.ask[0].content, onError: ({ error }) => { throw error; } });
      for await (const piece of out.partialOutputStream) void piece;
      const object = await out.output;
      return expect(equal(object, C.person), object);
    };
    calls[`${provider} embed, embedMany`] = async () => {
      const { embed, embedMany } = await load('ai');
      const model = (await demo())[1];
      const one = await embed({ model, value: C.texts[0] });
      const many = await embedMany({ model, values: C.texts });
      expect(equal(many.embeddings[0].map((x) => x.toFixed(5)), one.embedding.map((x) => x.toFixed(5))), 'embed != embedMany[0]');
      return unitVectors(many.embeddings, C.texts.length);
    };
  }
  return calls;
}

// ---------------------------------------------------------------- LangChain JS

async function langchainRoundTrip(model, streamed) {
  const { HumanMessage, ToolMessage } = await load('@langchain/core/messages');
  const bound = model.bindTools([C.weather_tool]);
  const history = [new HumanMessage(C.weather_ask[0].content)];
  let first = null;
  if (streamed) {
    for await (const chunk of await bound.stream(history)) first = first === null ? chunk : first.concat(chunk);
  } else {
    first = await bound.invoke(history);
  }
  expect(first.tool_calls?.length === 1 && equal(first.tool_calls[0].args, { city: 'Paris' }), first.tool_calls);
  history.push(first, new ToolMessage({ content: C.tool_result, tool_call_id: first.tool_calls[0].id }));
  const second = await bound.invoke(history);
  return expect(second.text.includes(C.tool_result), second.content);
}

async function langchainStructured(model, options) {
  const out = await model.withStructuredOutput(await personSchema(), options).invoke(C.ask[0].content);
  return expect(equal(out, C.person), out);
}

async function langchainText(model, streamed) {
  if (!streamed) {
    const out = await model.invoke(C.ask[0].content);
    return expect(Boolean(out.text), out.content);
  }
  let text = '';
  for await (const chunk of await model.stream(C.ask[0].content)) text += chunk.text;
  return expect(Boolean(text), text);
}

function langchainOpenaiCalls() {
  const chat = async (base, model, extra = {}) => {
    const { ChatOpenAI } = await load('@langchain/openai');
    return new ChatOpenAI({ model, apiKey: 'unused', configuration: { baseURL: `${base}/v1` }, ...extra });
  };
  const demo = (extra) => chat(C.demo, C.demo_model, { maxTokens: C.n, temperature: 0, ...extra });
  const scripted = (extra) => chat(C.scripted, C.scripted_model, extra);
  return {
    'ChatOpenAI invoke': async () => langchainText(await demo(), false),
    'ChatOpenAI stream': async () => langchainText(await demo(), true),
    'ChatOpenAI useResponsesApi invoke': async () => langchainText(await demo({ useResponsesApi: true }), false),
    'ChatOpenAI useResponsesApi stream': async () => langchainText(await demo({ useResponsesApi: true }), true),
    'bindTools round trip, invoke': async () => langchainRoundTrip(await scripted(), false),
    'bindTools round trip, stream': async () => langchainRoundTrip(await scripted(), true),
    'bindTools round trip, useResponsesApi': async () => langchainRoundTrip(await scripted({ useResponsesApi: true }), false),
    'bindTools round trip, useResponsesApi stream': async () =>
      langchainRoundTrip(await scripted({ useResponsesApi: true }), true),
    'withStructuredOutput default': async () => langchainStructured(await scripted()),
    'withStructuredOutput jsonSchema': async () => langchainStructured(await scripted(), { method: 'jsonSchema' }),
    // LangChain JS names the function `extract` unless given a name (Python's names it after the class); the
    // scripted engine calls only a function named Person
    'withStructuredOutput functionCalling': async () =>
      langchainStructured(await scripted(), { method: 'functionCalling', name: 'Person' }),
    'withStructuredOutput jsonMode': async () => langchainStructured(await scripted(), { method: 'jsonMode' }),
    'error: unknown model': async () => {
      const e = await (await chat(C.demo, 'no-such-model', { maxRetries: 0 })).invoke('Hi').then(() => null, (err) => err);
      return expect(e?.status === 404 && e.message.includes('no-such-model') && e.lc_error_code === 'MODEL_NOT_FOUND',
        { name: e?.name, status: e?.status, code: e?.lc_error_code, message: e?.message });
    },
    'OpenAIEmbeddings embedDocuments, embedQuery': async () => {
      const { OpenAIEmbeddings } = await load('@langchain/openai');
      const e = new OpenAIEmbeddings({ model: C.demo_model, apiKey: 'unused', configuration: { baseURL: `${C.demo}/v1` } });
      return unitVectors([...await e.embedDocuments(C.texts.slice(0, 1)), await e.embedQuery(C.texts[1])], 2);
    },
  };
}

function langchainOllamaCalls() {
  const chat = async (base, model, extra = {}) => {
    const { ChatOllama } = await load('@langchain/ollama');
    return new ChatOllama({ model, baseUrl: base, ...extra });
  };
  const demo = () => chat(C.demo, C.demo_model, { numPredict: C.n, temperature: 0 });
  const scripted = () => chat(C.scripted, C.scripted_model);
  return {
    'ChatOllama invoke': async () => langchainText(await demo(), false),
    'ChatOllama stream': async () => langchainText(await demo(), true),
    'bindTools round trip, invoke': async () => langchainRoundTrip(await scripted(), false),
    'bindTools round trip, stream': async () => langchainRoundTrip(await scripted(), true),
    'withStructuredOutput default': async () => langchainStructured(await scripted()),
    'withStructuredOutput jsonSchema': async () => langchainStructured(await scripted(), { method: 'jsonSchema' }),
    // LangChain JS names the function `extract` unless given a name (Python's names it after the class); the
    // scripted engine calls only a function named Person
    'withStructuredOutput functionCalling': async () =>
      langchainStructured(await scripted(), { method: 'functionCalling', name: 'Person' }),
    'error: unknown model': async () => {
      const e = await (await chat(C.demo, 'no-such-model', { maxRetries: 0 })).invoke('Hi').then(() => null, (err) => err);
      return expect(Boolean(e) && e.message.includes('no-such-model'), { name: e?.name, message: e?.message });
    },
    'OllamaEmbeddings embedDocuments': async () => {
      const { OllamaEmbeddings } = await load('@langchain/ollama');
      return unitVectors(await new OllamaEmbeddings({ model: C.demo_model, baseUrl: C.demo }).embedDocuments(C.texts),
        C.texts.length);
    },
  };
}

// ---------------------------------------------------------------- ollama (ollama-js)

function ollamaCalls() {
  const client = async (host) => new (await load('ollama')).Ollama({ host });
  const options = { num_predict: C.n, temperature: 0 };

  async function tools(streamed) {
    const ollama = await client(C.scripted);
    const messages = [...C.weather_ask];
    let calls = [];
    if (streamed) {
      const stream = await ollama.chat({ model: C.scripted_model, messages, tools: [C.weather_tool], stream: true });
      for await (const part of stream) calls.push(...(part.message.tool_calls ?? []));
    } else {
      calls = (await ollama.chat({ model: C.scripted_model, messages, tools: [C.weather_tool] })).message.tool_calls ?? [];
    }
    expect(calls.length === 1 && equal(calls[0].function.arguments, { city: 'Paris' }), calls);
    messages.push({ role: 'assistant', content: '', tool_calls: calls },
      { role: 'tool', content: C.tool_result, tool_name: 'get_weather' });
    const second = await ollama.chat({ model: C.scripted_model, messages, tools: [C.weather_tool] });
    return expect(second.message.content.includes(C.tool_result), second.message);
  }

  const names = (listing) => listing.models.map((m) => m.model);
  return {
    chat: async () => {
      const out = await (await client(C.demo)).chat({ model: C.demo_model, messages: C.ask, options });
      return expect(Boolean(out.message.content) && out.done && out.eval_count > 0, out);
    },
    'chat stream': async () => {
      let text = '';
      let last = null;
      for await (const part of await (await client(C.demo)).chat(
        { model: C.demo_model, messages: C.ask, options, stream: true })) {
        text += part.message.content;
        last = part;
      }
      return expect(Boolean(text) && last?.done, { text, last });
    },
    generate: async () => {
      const out = await (await client(C.demo)).generate({ model: C.demo_model, prompt: 'Once upon a time', options });
      return expect(Boolean(out.response) && out.done, out.response);
    },
    'generate stream': async () => {
      let text = '';
      for await (const part of await (await client(C.demo)).generate(
        { model: C.demo_model, prompt: 'Once upon a time', options, stream: true })) text += part.response;
      return expect(Boolean(text), text);
    },
    'tools round trip': () => tools(false),
    'tools round trip, stream': () => tools(true),
    'format=json schema': async () => {
      const out = await (await client(C.scripted)).chat(
        { model: C.scripted_model, messages: C.ask, format: C.person_schema });
      return expect(equal(JSON.parse(out.message.content), C.person), out.message.content);
    },
    embed: async () => unitVectors(
      (await (await client(C.demo)).embed({ model: C.demo_model, input: C.texts })).embeddings, C.texts.length),
    // the older route: one vector, not normalized (as Ollama's)
    embeddings: async () => {
      const v = (await (await client(C.demo)).embeddings({ model: C.demo_model, prompt: C.texts[0] })).embedding;
      return expect(v.length > 0 && Math.abs(v.reduce((s, x) => s + x * x, 0) - 1) > 1e-3, v.length);
    },
    'error: unknown model is ResponseError': async () => {
      const e = await (await client(C.demo)).chat({ model: 'no-such-model', messages: C.ask }).then(() => null, (err) => err);
      return expect(e?.name === 'ResponseError' && e.status_code === 404 && e.error.includes('no-such-model'),
        { name: e?.name, status: e?.status_code, error: e?.error });
    },
    list: async () => {
      const n = names(await (await client(C.demo)).list());
      return expect(n.includes(C.demo_model) || n.includes(`${C.demo_model}:latest`), n);
    },
    show: async () => {
      const out = await (await client(C.demo)).show({ model: C.demo_model });
      return expect(Boolean(out.model_info) && Boolean(out.details), out.details);
    },
    ps: async () => expect(names(await (await client(C.demo)).ps()).length === 1, 'ps'),
  };
}

const LIBRARIES = {
  openai: openaiCalls, 'vercel-ai': aiCalls, 'langchain-openai': langchainOpenaiCalls,
  'langchain-ollama': langchainOllamaCalls, ollama: ollamaCalls,
};

// the AI SDK's warnings (a setting the provider dropped, say) go with the result instead of to the console
const warnings = [];
globalThis.AI_SDK_LOG_WARNINGS = (options) => warnings.push(...options.warnings);

async function main() {
  const [library, call] = process.argv.slice(2);
  if (library === '--list') {
    const listing = Object.fromEntries(Object.entries(LIBRARIES).map(([name, calls]) => [name, Object.keys(calls())]));
    return console.log(JSON.stringify(listing));
  }
  try {
    const detail = await LIBRARIES[library]()[call]();
    console.log(JSON.stringify({ passed: true, detail: warnings.length ? `${detail} warnings=${JSON.stringify(warnings)}` : detail }));
  } catch (e) {
    const where = (e.stack ?? '').split('\n').filter((l) => l.includes('node_clients.mjs')).slice(0, 3);
    const extra = e.responseBody ?? e.error ?? e.cause?.message;
    const error = `${e.name}: ${e.message}${extra ? ` ${JSON.stringify(extra)}` : ''}`.slice(0, 800);
    console.log(JSON.stringify({ passed: false, error, where }));
  }
}

await main();
