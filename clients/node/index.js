'use strict';
// A small client for a splitserve router: the splitserve.v1.Inference service, loaded at run time from the
// shipped .proto files with @grpc/proto-loader (no generated code). Streams are async iterators.
//
//   const { Client } = require('@splitserve/client');
//   const client = new Client('127.0.0.1:50051', { apiKey: process.env.SPLITSERVE_API_KEY });
//   for await (const chunk of client.generateStream('The capital of France is', { temperature: 0 })) {
//     process.stdout.write(chunk.text);
//   }
//   client.close();

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

// The repository's protos/ (or SPLITSERVE_PROTOS, for a copy elsewhere).
const PROTOS = process.env.SPLITSERVE_PROTOS || path.join(__dirname, '..', '..', 'protos');

function loadInference(protosDir = PROTOS) {
  const definition = protoLoader.loadSync(path.join(protosDir, 'splitserve', 'v1', 'inference.proto'), {
    includeDirs: [protosDir],
    keepCase: false, // fields in lowerCamelCase, as JavaScript spells them
    longs: Number,
    enums: String, // enum values by name: 'FINISH_REASON_STOP'
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).splitserve.v1;
}

// What the router's messages may be (a long prompt's logprobs, say), as its servers send them; grpc-js takes 4 MB.
const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

// Sampling parameters as a plain object, in camelCase: { maxTokens, temperature, topP, topK, stop, seed,
// promptLogprobs, structuredOutputs: { json: '<schema text>' } (or { regex }, { choice: { values: [...] } },
// { grammar }, { jsonObject: true }), ... }. A chat with function tools is { messages, tools: [{ name, description,
// parameters: '<JSON schema text>' }] }, its messages carrying toolCalls: [{ id, name, arguments: '<JSON text>' }]
// (an assistant's) and toolCallId (a tool's answer); a call is forced with structuredOutputs: { json: parameters }. With echo, the message with the first token carries the prompt's text (promptText), with
// returnPromptTokenIds its token ids (promptTokenIds). addSpecialTokens: whether the tokenizer adds its special tokens
// (a BOS) to a text or rendered chat (unset: the router's default, yes for text and no for chats). beamSearch
// ({ beamWidth, lengthPenalty }, generateStream only) searches with beams instead of sampling: params then give
// maxTokens and ignoreEos alone, and the stream carries beamWidth completions, best first (each chunk's index).
function generateRequest(prompt, params = {}, requestId, echo = false, priority = 0, loraName = '', cacheSalt,
  returnPromptTokenIds = false, addSpecialTokens, beamSearch) {
  const request = { samplingParams: params, echo, priority, loraName, returnPromptTokenIds };
  if (beamSearch !== undefined) request.beamSearch = beamSearch;
  if (requestId !== undefined) request.requestId = requestId;
  if (cacheSalt !== undefined) request.cacheSalt = cacheSalt;
  if (addSpecialTokens !== undefined) request.addSpecialTokens = addSpecialTokens;
  if (typeof prompt === 'string') request.text = prompt;
  else if (Array.isArray(prompt) && prompt.length && typeof prompt[0] === 'object') request.chat = { messages: prompt };
  else if (Array.isArray(prompt)) request.tokenIds = { ids: prompt };
  else if (prompt && Array.isArray(prompt.messages)) request.chat = prompt;
  else throw new TypeError('prompt must be a string, an array of token ids, an array of {role, content} messages, '
    + 'or a chat: { messages, tools }');
  return request;
}

class Client {
  /**
   * @param {string} address the router's host:port
   * @param {object} [options]
   * @param {string} [options.apiKey] sent as 'authorization: Bearer KEY' on every call
   * @param {{ca?: string, cert?: string, key?: string}} [options.tls] PEM file paths: TLS to the router
   *   (verified against ca, else the system roots; cert and key for mutual TLS). Plaintext without.
   * @param {number} [options.timeoutSeconds] default deadline of each call
   */
  constructor(address, options = {}) {
    const Inference = loadInference(options.protosDir).Inference;
    let credentials = grpc.credentials.createInsecure();
    if (options.tls) {
      const read = (file) => (file ? fs.readFileSync(file) : null);
      credentials = grpc.credentials.createSsl(read(options.tls.ca), read(options.tls.key), read(options.tls.cert));
    }
    this.stub = new Inference(address, credentials, { 'grpc.max_receive_message_length': MAX_MESSAGE_BYTES });
    this.apiKey = options.apiKey;
    this.timeoutSeconds = options.timeoutSeconds;
  }

  _metadata() {
    const metadata = new grpc.Metadata();
    if (this.apiKey) metadata.set('authorization', `Bearer ${this.apiKey}`);
    return metadata;
  }

  _options(timeoutSeconds) {
    const seconds = timeoutSeconds ?? this.timeoutSeconds;
    return seconds ? { deadline: new Date(Date.now() + seconds * 1000) } : {};
  }

  _unary(method, request, timeoutSeconds) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this._metadata(), this._options(timeoutSeconds), (error, response) =>
        error ? reject(error) : resolve(response));
    });
  }

  /** The whole completion: { text, tokenIds, finishReason, usage, timing, promptLogprobs, promptText, ... }.
   * Rejects with a gRPC error ({ code, details }) for a refused request. */
  generate(prompt, params = {}, { requestId, timeoutSeconds, echo, priority, loraName, cacheSalt,
    returnPromptTokenIds, addSpecialTokens } = {}) {
    return this._unary('generate', generateRequest(prompt, params, requestId, echo, priority, loraName, cacheSalt,
      returnPromptTokenIds, addSpecialTokens), timeoutSeconds);
  }

  /** The streamed chunks, an async iterator; `.cancel()` on it ends the request on the workers. */
  generateStream(prompt, params = {}, { requestId, timeoutSeconds, echo, priority, loraName, cacheSalt,
    returnPromptTokenIds, addSpecialTokens, beamSearch } = {}) {
    return this.stub.generateStream(generateRequest(prompt, params, requestId, echo, priority, loraName, cacheSalt,
      returnPromptTokenIds, addSpecialTokens, beamSearch), this._metadata(), this._options(timeoutSeconds));
  }

  /** The prompt's embedding (Embed): its last token's final hidden state, an array of numbers of unit length
   * unless normalize is false, its first `dimensions` values where given. Rejects with a gRPC error as generate. */
  async embed(prompt, { normalize = true, dimensions, loraName = '', requestId, timeoutSeconds, cacheSalt,
    priority = 0, addSpecialTokens } = {}) {
    const request = { ...generateRequest(prompt, {}, requestId, false, priority, loraName, cacheSalt, false,
      addSpecialTokens), normalize };
    delete request.samplingParams;
    delete request.echo;
    delete request.returnPromptTokenIds;
    if (dimensions !== undefined) request.dimensions = dimensions;
    return (await this._unary('embed', request, timeoutSeconds)).embedding;
  }

  async abort(requestId) {
    return (await this._unary('abort', { requestId }, 10)).found;
  }

  async tokenize(text) {
    return (await this._unary('tokenize', { text }, 30)).tokenIds;
  }

  modelInfo() {
    return this._unary('getModelInfo', {}, 10);
  }

  clusterStatus() {
    return this._unary('getClusterStatus', {}, 10);
  }

  close() {
    this.stub.close();
  }
}

module.exports = { Client, loadInference, generateRequest, status: grpc.status };
