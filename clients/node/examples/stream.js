'use strict';
// Stream a greedy reply from a splitserve router:
//   node examples/stream.js 127.0.0.1:50051 "The capital of France is" [max_tokens]
// An API key, when the router requires one, comes from SPLITSERVE_API_KEY. With --json, prints one JSON
// line of the token ids, text and finish reason instead of the text.
const { Client } = require('..');

async function main() {
  const args = process.argv.slice(2).filter((arg) => arg !== '--json');
  const json = process.argv.includes('--json');
  const [address, prompt, maxTokens = '32'] = args;
  if (!address || !prompt) {
    console.error('usage: node examples/stream.js ADDRESS PROMPT [MAX_TOKENS] [--json]');
    process.exit(2);
  }
  const client = new Client(address, { apiKey: process.env.SPLITSERVE_API_KEY });
  const tokenIds = [];
  let text = '';
  let finishReason = null;
  try {
    for await (const chunk of client.generateStream(prompt, { temperature: 0, maxTokens: Number(maxTokens) })) {
      tokenIds.push(...chunk.tokenIds);
      text += chunk.text;
      if (!json) process.stdout.write(chunk.text);
      if (chunk.finishReason !== 'FINISH_REASON_UNSPECIFIED') finishReason = chunk.finishReason;
    }
  } catch (error) {
    console.error(`error: ${error.code} ${error.details}`);
    process.exitCode = 1;
    return;
  } finally {
    client.close();
  }
  if (json) console.log(JSON.stringify({ tokenIds, text, finishReason }));
  else console.log(`\n[${finishReason}]`);
}

main();
