// A small outboxd relay in JavaScript. It shows that the relay protocol
// (proto/outbox/v1/relay_service.proto) works from any language with gRPC:
//
//   1. Subscribe with a relay id, a credit (max_in_flight: the server never
//      has more unacknowledged deliveries outstanding on the stream) and a
//      lease TTL. The server streams one delivery per message: an event and
//      the lease token that proves this relay holds it. It leases one event
//      per aggregate at a time, so publishing deliveries concurrently never
//      reorders an aggregate.
//   2. Publish each event to the sink: stdout (one JSON line) or a webhook
//      (an HTTP POST, signed as outboxd's own webhook sink signs: Standard
//      Webhooks' webhook-id, webhook-timestamp and webhook-signature).
//   3. Only once the publish succeeded, Ack the event with its lease token
//      (acks are batched: those that complete while one Ack call is in
//      flight share the next). The server marks it published and hands out
//      the aggregate's next revision. On failure, Nack it with the error:
//      the server retries it with backoff, then parks the aggregate. A
//      failure that retrying cannot mend (a webhook's 4xx other than 408
//      and 429) is nacked as permanent: the aggregate parks at once.
//
// A lease that is neither acked nor nacked within its TTL expires and the
// event is delivered again, so this relay bounds each publish by half the
// lease's remaining time instead of extending leases (ExtendLease, which the
// Go relay uses for slow brokers). Delivery is at least once: consumers
// deduplicate by event_id.
//
// Usage:
//
//   node relay.js [--server 127.0.0.1:7070] [--sink stdout|https://host/path]
//                 [--secret-file FILE] [--relay-id ID] [--streams a,b]
//                 [--max-in-flight 16] [--lease-ttl 30]
//
// A webhook sink needs --secret-file: a file of whsec_... secrets, one a
// line, the format of the Go sink's secret_file; every one signs each
// request.
//
// OUTBOXD_TOKEN, when set, is sent as the bearer token. Logs go to stderr.
// SIGTERM or SIGINT: stop taking deliveries, finish the publishes under way,
// ack them, close the stream and exit 0.

import crypto from 'node:crypto';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { setTimeout as sleep } from 'node:timers/promises';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const { values: args } = parseArgs({
  options: {
    server: { type: 'string', default: '127.0.0.1:7070' },
    sink: { type: 'string', default: 'stdout' },
    'secret-file': { type: 'string', default: '' },
    'relay-id': { type: 'string', default: `node-${os.hostname()}-${process.pid}` },
    streams: { type: 'string', default: '' },
    'max-in-flight': { type: 'string', default: '16' },
    'lease-ttl': { type: 'string', default: '30' },
  },
});

const maxInFlight = Number(args['max-in-flight']);
const leaseTTLSeconds = Number(args['lease-ttl']);
if (!Number.isInteger(maxInFlight) || maxInFlight < 1) usage(`--max-in-flight ${args['max-in-flight']}: want a positive integer`);
if (!Number.isInteger(leaseTTLSeconds) || leaseTTLSeconds < 1) usage(`--lease-ttl ${args['lease-ttl']}: want whole seconds`);

// The repository's proto files, loaded at run time: no generated code.
const protoDir = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../proto');
const definition = protoLoader.loadSync('outbox/v1/relay_service.proto', {
  includeDirs: [protoDir],
  keepCase: true, // field names as in the .proto: event_id, lease_token
  longs: String, // int64 revision as a decimal string, converted below
  enums: String, // ack statuses by name
  defaults: true,
});
const { RelayService } = grpc.loadPackageDefinition(definition).outbox.v1;
const client = new RelayService(args.server, grpc.credentials.createInsecure());

const publish = args.sink === 'stdout' ? publishToStdout : webhook(args.sink, readSecrets(args['secret-file']));

// --- sinks -----------------------------------------------------------------

// The JSON shape outboxd's own stdout sink prints. source is there only for
// an event of a source other than default (a server of several databases),
// and republish_action only for a copy an operator's republish made: the
// action's id, the same on each retry of that copy.
function toJSON(d) {
  const ev = d.event;
  const republishAction = Number(d.republish_action_id);
  return JSON.stringify({
    event_id: ev.event_id,
    stream: ev.stream,
    aggregate_key: ev.aggregate_key,
    revision: Number(ev.revision),
    event_type: ev.event_type,
    payload: JSON.parse(ev.payload.toString('utf8')),
    headers: ev.headers,
    created_at: timestamp(ev.created_at),
    attempt: d.attempt,
    ...(ev.source && ev.source !== 'default' ? { source: ev.source } : {}),
    ...(republishAction !== 0 ? { republish_action: republishAction } : {}),
  });
}

// messageID is what receivers deduplicate on: the event id, prefixed with
// its source when that is not default (event ids are unique per source).
function messageID(ev) {
  return ev.source && ev.source !== 'default' ? `${ev.source}/${ev.event_id}` : ev.event_id;
}

// publishToStdout resolves once the line is handed to the operating system
// (a write to a pipe completes later than write() returns).
function publishToStdout(d) {
  return new Promise((resolve, reject) => {
    process.stdout.write(toJSON(d) + '\n', (err) => (err ? reject(err) : resolve()));
  });
}

// readSecrets reads whsec_ secrets, one a line, as outboxd's webhook sink
// does (relay/sink/webhook.go): base64 after the prefix, at least 24 bytes.
function readSecrets(file) {
  if (!file) usage('a webhook sink needs --secret-file (a file holding the whsec_... signing secret)');
  let text;
  try {
    text = fs.readFileSync(file, 'utf8');
  } catch (err) {
    usage(`--secret-file ${file}: ${err.message}`);
  }
  const keys = [];
  text.split('\n').forEach((line, i) => {
    line = line.trim();
    if (line === '') return;
    if (!line.startsWith('whsec_')) usage(`--secret-file ${file}: line ${i + 1}: want a secret starting with "whsec_"`);
    const key = Buffer.from(line.slice('whsec_'.length), 'base64');
    if (key.length < 24) usage(`--secret-file ${file}: line ${i + 1}: the secret is ${key.length} bytes; want at least 24`);
    keys.push(key);
  });
  if (keys.length === 0) usage(`--secret-file ${file}: no secret in the file`);
  return keys;
}

// sign returns the webhook-signature header: "v1," and the base64
// HMAC-SHA256 of "id.timestamp.body" under each key, space-separated.
function sign(keys, id, timestamp, body) {
  return keys
    .map((k) => 'v1,' + crypto.createHmac('sha256', k).update(`${id}.${timestamp}.${body}`).digest('base64'))
    .join(' ');
}

// webhook POSTs each event as JSON, signed; any 2xx answer is success. The
// message id (messageID) goes in webhook-id so the receiver can deduplicate
// redeliveries.
// 408, 429 and 5xx are retried (after Retry-After when given); any other
// 4xx is permanent, as in the Go sink: the receiver refused these bytes, so
// the aggregate parks with the status as its reason instead of being
// retried forever. Redirects are not followed.
function webhook(url, keys) {
  if (!/^https?:\/\//.test(url)) usage(`--sink ${url}: want stdout or an http(s) URL`);
  return async (d, signal) => {
    const body = toJSON(d);
    const id = messageID(d.event);
    const timestamp = String(Math.floor(Date.now() / 1000));
    const res = await fetch(url, {
      method: 'POST',
      headers: {
        'content-type': 'application/json',
        'user-agent': 'outboxd-relay-node',
        'webhook-id': id,
        'webhook-timestamp': timestamp,
        'webhook-signature': sign(keys, id, timestamp, body),
      },
      body,
      redirect: 'manual',
      signal,
    });
    if (res.ok) return;
    const excerpt = (await res.text()).slice(0, 200);
    const err = new Error(`webhook answered ${res.status}: ${excerpt}`);
    if (res.status === 408 || res.status === 429 || res.status >= 500) {
      err.retryAfterSeconds = Number(res.headers.get('retry-after')) || 0;
    } else if (res.status >= 400) {
      err.message += ' (refused by the receiver; retrying will not help until it changes)';
      err.permanent = true;
    }
    throw err;
  };
}

// --- the protocol ----------------------------------------------------------

const inFlight = new Set();
let stream = null; // the current Subscribe call
let stopping = false;

async function handle(d) {
  const id = d.event.event_id;
  try {
    // Half the lease's remaining life, so a hung publish is nacked while
    // this relay still holds the lease.
    await publish(d, AbortSignal.timeout(Math.max(1000, seconds(d.lease_ttl_remaining) * 500)));
  } catch (err) {
    log('publish failed; nacking', { event_id: id, attempt: d.attempt, err: err.message });
    const req = { event_id: id, lease_token: d.lease_token, error: err.message, permanent: err.permanent === true };
    if (err.retryAfterSeconds > 0) req.retry_after = { seconds: err.retryAfterSeconds, nanos: 0 };
    try {
      await unary('Nack', req);
    } catch (nackErr) {
      // The lease then expires by itself and the event comes again.
      log('nack failed', { event_id: id, err: nackErr.message });
      if (isRefusal(nackErr)) fatal(nackErr);
    }
    return;
  }
  acks.add({ event_id: id, lease_token: d.lease_token });
}

// Acks batches acks: one Ack call at a time, carrying every ack that
// completed meanwhile (at most 1000, the server's limit).
class Acks {
  #pending = [];
  #sending = null;

  add(item) {
    this.#pending.push(item);
    this.#send();
  }

  // flushed resolves when every ack added so far has been answered.
  async flushed() {
    while (this.#sending) await this.#sending;
  }

  #send() {
    if (this.#sending || this.#pending.length === 0) return;
    const batch = this.#pending.splice(0, 1000);
    this.#sending = this.#ack(batch).finally(() => {
      this.#sending = null;
      this.#send();
    });
  }

  async #ack(batch) {
    for (let attempt = 1; ; attempt++) {
      try {
        const { results } = await unary('Ack', { acks: batch });
        for (const [i, r] of results.entries()) {
          if (r.status === 'ACK_STATUS_RETRY') this.#pending.push(batch[i]);
          else if (r.status !== 'ACK_STATUS_PUBLISHED' && r.status !== 'ACK_STATUS_ALREADY_PUBLISHED') {
            // LEASE_LOST, NOT_FOUND, INVALID: the event is redelivered (or
            // was published by another relay); nothing to do here.
            log('ack not taken', { event_id: r.event_id, status: r.status, message: r.message });
          }
        }
        return;
      } catch (err) {
        if (isRefusal(err)) return fatal(err);
        if (attempt >= 5 || !isTransient(err)) {
          log('acks given up; their events will be delivered again', { n: batch.length, err: err.message });
          return;
        }
        await sleep(100 * 2 ** attempt);
      }
    }
  }
}
const acks = new Acks();

// subscribe runs one Subscribe stream until it ends and resolves with its
// final status.
function subscribe() {
  return new Promise((resolve) => {
    stream = client.Subscribe(
      {
        relay_id: args['relay-id'],
        streams: args.streams ? args.streams.split(',') : [],
        max_in_flight: maxInFlight,
        lease_ttl: { seconds: leaseTTLSeconds, nanos: 0 },
      },
      metadata(),
    );
    stream.on('data', (d) => {
      if (stopping) return; // not started: released when the stream closes
      const p = handle(d).finally(() => inFlight.delete(p));
      inFlight.add(p);
    });
    stream.on('error', () => {}); // reported by 'status'
    stream.on('status', resolve);
  });
}

async function run() {
  let delay = 100;
  while (!stopping) {
    const started = Date.now();
    const status = await subscribe();
    if (stopping) break;
    if (isRefusal(status) || status.code === grpc.status.INVALID_ARGUMENT) return fatal(status);
    if (Date.now() - started > 10_000) delay = 100; // it ran fine for a while
    log('stream ended; reconnecting', { code: grpc.status[status.code], details: status.details, in_ms: delay });
    await sleep(delay / 2 + Math.random() * (delay / 2));
    delay = Math.min(delay * 2, 10_000);
  }
}

// stop lets the publishes under way finish (up to 10 s), acks them and only
// then closes the stream, so their leases stay held meanwhile. Every call
// returns the same promise.
let stopped = null;
function stop() {
  stopped ??= (async () => {
    stopping = true;
    log('stopping');
    await Promise.race([Promise.allSettled([...inFlight]), sleep(10_000, undefined, { ref: false })]);
    await acks.flushed();
    stream?.cancel();
  })();
  return stopped;
}

function fatal(err) {
  log('refused by the server; exiting', { code: grpc.status[err.code], details: err.details });
  process.exitCode = 1;
  stop();
}

// --- helpers ---------------------------------------------------------------

function unary(method, req) {
  return new Promise((resolve, reject) => {
    client[method](req, metadata(), { deadline: Date.now() + 10_000 }, (err, res) => (err ? reject(err) : resolve(res)));
  });
}

function metadata() {
  const md = new grpc.Metadata();
  if (process.env.OUTBOXD_TOKEN) md.set('authorization', `Bearer ${process.env.OUTBOXD_TOKEN}`);
  return md;
}

// Credentials refused: retrying will not help.
function isRefusal(err) {
  return err.code === grpc.status.UNAUTHENTICATED || err.code === grpc.status.PERMISSION_DENIED;
}

function isTransient(err) {
  return [grpc.status.UNAVAILABLE, grpc.status.DEADLINE_EXCEEDED, grpc.status.RESOURCE_EXHAUSTED].includes(err.code);
}

function seconds(d) {
  return d ? Number(d.seconds) + d.nanos / 1e9 : 0;
}

function timestamp(t) {
  if (!t) return null;
  return new Date(Number(t.seconds) * 1000 + Math.floor(t.nanos / 1e6)).toISOString();
}

function log(msg, fields = {}) {
  console.error(JSON.stringify({ time: new Date().toISOString(), msg, ...fields }));
}

function usage(msg) {
  console.error(`relay.js: ${msg}`);
  process.exit(2);
}

process.on('SIGTERM', () => stop());
process.on('SIGINT', () => stop());
log('relay running', { server: args.server, sink: args.sink, relay_id: args['relay-id'] });
await run();
await stop();
client.close();
