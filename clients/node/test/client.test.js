'use strict';
// Run against a live router: SPLITSERVE_ADDRESS (host:port) and SPLITSERVE_API_KEY (when it requires one).
// tests/e2e/test_node_client.py starts a cluster and runs this file with `node --test`.
const test = require('node:test');
const assert = require('node:assert/strict');
const { Client, status } = require('..');

const address = process.env.SPLITSERVE_ADDRESS;
const apiKey = process.env.SPLITSERVE_API_KEY;
const PROMPT = 'The capital of France is';

test('streams a greedy reply whose chunks make up the unary reply', async () => {
  const client = new Client(address, { apiKey, timeoutSeconds: 120 });
  try {
    const whole = await client.generate(PROMPT, { temperature: 0, maxTokens: 12 });
    assert.equal(whole.tokenIds.length, 12);
    assert.equal(whole.finishReason, 'FINISH_REASON_LENGTH');
    assert.equal(whole.usage.completionTokens, 12);
    const ids = [];
    let text = '';
    for await (const chunk of client.generateStream(PROMPT, { temperature: 0, maxTokens: 12 })) {
      ids.push(...chunk.tokenIds);
      text += chunk.text;
    }
    assert.deepEqual(ids, whole.tokenIds);
    assert.equal(text, whole.text);
  } finally {
    client.close();
  }
});

test('n completions stream on one call, each message saying its index', async () => {
  const client = new Client(address, { apiKey, timeoutSeconds: 120 });
  try {
    const whole = await client.generate(PROMPT, { temperature: 0, maxTokens: 6 });
    const ids = [[], [], []];
    const finishes = [];
    for await (const chunk of client.generateStream(PROMPT, { temperature: 0, maxTokens: 6, n: 3 })) {
      ids[chunk.index].push(...chunk.tokenIds);
      if (chunk.finishReason !== 'FINISH_REASON_UNSPECIFIED') finishes.push(chunk.index);
    }
    assert.deepEqual(ids, [whole.tokenIds, whole.tokenIds, whole.tokenIds]);
    assert.deepEqual(finishes.sort(), [0, 1, 2]);
  } finally {
    client.close();
  }
});

test('chat messages and token ids are prompts too', async () => {
  const client = new Client(address, { apiKey, timeoutSeconds: 120 });
  try {
    const chat = await client.generate([{ role: 'user', content: 'What is the capital of France?' }],
      { temperature: 0, maxTokens: 32 });
    assert.equal(chat.text, 'The capital of France is Paris.');
    assert.equal(chat.finishReason, 'FINISH_REASON_STOP');
    const tokenIds = await client.tokenize(PROMPT);
    const byIds = await client.generate(tokenIds, { temperature: 0, maxTokens: 4 });
    const byText = await client.generate(PROMPT, { temperature: 0, maxTokens: 4 });
    assert.deepEqual(byIds.tokenIds, byText.tokenIds);
  } finally {
    client.close();
  }
});

test('a prompt is scored and echoed, its token ids returned', async () => {
  const client = new Client(address, { apiKey, timeoutSeconds: 120 });
  try {
    const tokenIds = await client.tokenize(PROMPT);
    const reply = await client.generate(PROMPT, { temperature: 0, maxTokens: 1, promptLogprobs: 2 },
      { echo: true, returnPromptTokenIds: true });
    assert.equal(reply.promptText, PROMPT);
    assert.deepEqual(reply.promptTokenIds, tokenIds);
    assert.deepEqual((await client.generate(PROMPT, { temperature: 0, maxTokens: 1 })).promptTokenIds, []);
    // This tokenizer adds no special tokens, so the ids are the same either way; the router takes the field.
    const plain = await client.generate(PROMPT, { temperature: 0, maxTokens: 1 },
      { returnPromptTokenIds: true, addSpecialTokens: false });
    assert.deepEqual(plain.promptTokenIds, tokenIds);
    assert.deepEqual(reply.promptLogprobs.map((position) => position.sampled.tokenId), tokenIds);
    for (const position of reply.promptLogprobs.slice(1)) {
      assert.equal(position.top.length, 2);
      assert.ok(position.sampled.logprob <= 0 && position.sampled.logprob <= position.top[0].logprob + 1e-6);
    }
  } finally {
    client.close();
  }
});

test('structured outputs shape the reply: a JSON schema, a choice', async () => {
  const client = new Client(address, { apiKey, timeoutSeconds: 120 });
  try {
    const schema = { type: 'object', properties: { city: { type: 'string', maxLength: 24 } }, required: ['city'],
      additionalProperties: false };
    const shaped = await client.generate([{ role: 'user', content: 'What is the capital of France?' }],
      { temperature: 0, maxTokens: 40, structuredOutputs: { json: JSON.stringify(schema) } });
    assert.deepEqual(Object.keys(JSON.parse(shaped.text)), ['city']);
    assert.equal(shaped.finishReason, 'FINISH_REASON_STOP');
    const chosen = await client.generate(PROMPT, { temperature: 0, maxTokens: 8,
      structuredOutputs: { choice: { values: [' Paris', ' Lyon'] } } });
    assert.ok([' Paris', ' Lyon'].includes(chosen.text), chosen.text);
    await assert.rejects(client.generate(PROMPT, { structuredOutputs: { regex: '[0-' } }), (error) => {
      assert.equal(error.code, status.INVALID_ARGUMENT);
      assert.match(error.details, /the regex is not valid/);
      return true;
    });
  } finally {
    client.close();
  }
});

test('a chat carries tools and tool calls, a call is forced by its parameters schema, a priority, an adapter and a cache salt are sent', async () => {
  const client = new Client(address, { apiKey, timeoutSeconds: 120 });
  try {
    const parameters = JSON.stringify({ type: 'object', properties: { city: { type: 'string', maxLength: 20 } },
      required: ['city'], additionalProperties: false });
    const tools = [{ name: 'get_weather', description: 'The weather now in a city.', parameters }];
    const messages = [
      { role: 'user', content: 'What is the weather in Paris?' },
      { role: 'assistant', content: '', toolCalls: [{ id: 'call_1', name: 'get_weather', arguments: '{"city": "Paris"}' }] },
      { role: 'tool', toolCallId: 'call_1', content: '{"celsius": 21}' },
      { role: 'user', content: 'And in Lyon?' },
    ];
    const call = await client.generate({ messages, tools },
      { temperature: 0, maxTokens: 40, structuredOutputs: { json: parameters } });
    assert.deepEqual(Object.keys(JSON.parse(call.text)), ['city']);
    assert.equal(call.finishReason, 'FINISH_REASON_STOP');
    // This cluster's workers serve first come, first served: a priority is sent, and refused there.
    await assert.rejects(client.generate(PROMPT, { maxTokens: 1 }, { priority: 3 }), (error) => {
      assert.equal(error.code, status.INVALID_ARGUMENT);
      assert.match(error.details, /needs the priority scheduling policy/);
      return true;
    });
    // No worker here serves LoRA adapters: a name is sent, and not found there.
    await assert.rejects(client.generate(PROMPT, { maxTokens: 1 }, { loraName: 'sql' }), (error) => {
      assert.equal(error.code, status.NOT_FOUND);
      assert.match(error.details, /No worker serves LoRA adapter 'sql'/);
      return true;
    });
    // A cache salt is sent: a salted prompt finds its own salt's cached blocks (the router checks the salt).
    const long = `${PROMPT} ${'and the capital of Spain is Madrid, '.repeat(8)}`;
    await client.generate(long, { maxTokens: 1 }, { cacheSalt: 'node-tenant' });
    const again = await client.generate(long, { maxTokens: 1 }, { cacheSalt: 'node-tenant' });
    assert.ok(again.usage.cachedTokens > 0, JSON.stringify(again.usage));
    await assert.rejects(client.generate(PROMPT, { maxTokens: 1 }, { cacheSalt: '' }), (error) => {
      assert.equal(error.code, status.INVALID_ARGUMENT);
      assert.match(error.details, /cache_salt must be a string of 1 to 256 characters/);
      return true;
    });
    await assert.rejects(client.generate({ messages, tools: [{ name: 'get weather' }] }), (error) => {
      assert.equal(error.code, status.INVALID_ARGUMENT);
      assert.match(error.details, /1 to 64 letters, digits, underscores or hyphens/);
      return true;
    });
  } finally {
    client.close();
  }
});

test('embeddings: unit length, the same for text and its token ids, cut and raw on request', async () => {
  const client = new Client(address, { apiKey, timeoutSeconds: 120 });
  try {
    const vector = await client.embed(PROMPT);
    assert.ok(vector.length > 64);
    const norm = Math.sqrt(vector.reduce((sum, value) => sum + value * value, 0));
    assert.ok(Math.abs(norm - 1) < 1e-4, `norm ${norm}`);
    const byIds = await client.embed(await client.tokenize(PROMPT));
    assert.ok(byIds.every((value, index) => Math.abs(value - vector[index]) < 1e-4));
    const raw = await client.embed(PROMPT, { normalize: false, dimensions: 64 });
    assert.equal(raw.length, 64);
    const rawNorm = Math.sqrt(raw.reduce((sum, value) => sum + value * value, 0));
    assert.ok(rawNorm > 1.5, `raw norm ${rawNorm}`);  // the hidden state's own size, not scaled to 1
    await assert.rejects(client.embed(PROMPT, { dimensions: 100000 }), (error) => {
      assert.equal(error.code, status.INVALID_ARGUMENT);
      assert.match(error.details, /hidden size/);
      return true;
    });
    // A priority is sent as generate's is, and refused by these first-come, first-served workers.
    await assert.rejects(client.embed(PROMPT, { priority: 2 }), (error) => {
      assert.equal(error.code, status.INVALID_ARGUMENT);
      assert.match(error.details, /priority 2 needs the priority scheduling policy/);
      return true;
    });
  } finally {
    client.close();
  }
});

test('a refused request rejects with the status code and the router sentence', async () => {
  const client = new Client(address, { apiKey });
  try {
    await assert.rejects(client.generate(PROMPT, { temperature: 0 }, { requestId: 'not an id!' }), (error) => {
      assert.equal(error.code, status.INVALID_ARGUMENT);
      assert.match(error.details, /request_id/);
      return true;
    });
  } finally {
    client.close();
  }
  const stranger = new Client(address, { apiKey: 'not-the-key' });
  try {
    await assert.rejects(stranger.generate(PROMPT, { maxTokens: 1 }), (error) => error.code === status.UNAUTHENTICATED);
  } finally {
    stranger.close();
  }
});

test('a cancelled stream ends, and the cluster status shows every worker idle again', async () => {
  const client = new Client(address, { apiKey });
  try {
    const stream = client.generateStream(PROMPT, { temperature: 0, maxTokens: 2000, ignoreEos: true });
    for await (const chunk of stream) {
      if (chunk.tokenIds.length) {
        stream.cancel(); // the router aborts the request on the workers
        break;
      }
    }
    const deadline = Date.now() + 20000;
    let idle = false;
    while (!idle && Date.now() < deadline) {
      const { pools } = await client.clusterStatus();
      const workers = pools.flatMap((pool) => pool.workers);
      idle = workers.length > 0 && workers.every((w) => w.load.numFreeKvBlocks === w.load.numTotalKvBlocks);
      if (!idle) await new Promise((resolve) => setTimeout(resolve, 200));
    }
    assert.ok(idle, 'every KV block is free within 20 s of the cancel');
    const info = await client.modelInfo();
    assert.ok(info.maxModelLen > 0 && info.modelName.length > 0);
  } finally {
    client.close();
  }
});
