// The TypeScript SDK's side of bench/bench_tssdk.py: one node process, one
// client and sandbox (HUTCH_URL, HUTCH_TOKEN, argv: the SDK's dist/index.js and
// the sandbox id), measuring in batches the parent asks for on stdin
// ("exec N" or "file N"), each answered with one line of JSON: the batch's
// samples in milliseconds, and this process's CPU milliseconds for the batch.
import { createInterface } from "node:readline";
import { pathToFileURL } from "node:url";

const [sdkPath, sandboxId] = process.argv.slice(2);
const { Client } = await import(pathToFileURL(sdkPath).href);
const sandbox = await new Client().sandbox(sandboxId);
const data = new Uint8Array(1024 * 1024).map((_, i) => (i * 7919) % 251);

const operations = {
  exec: async () => {
    const result = await sandbox.exec(["true"]);
    if (result.exitCode !== 0) throw new Error(`exec true exited ${result.exitCode}`);
  },
  file: async () => {
    await sandbox.writeBytes("bench-ts.bin", data, { overwrite: true });
    const back = await sandbox.readBytes("bench-ts.bin");
    if (back.length !== data.length) throw new Error(`read ${back.length} bytes back`);
  },
};

for await (const line of createInterface({ input: process.stdin })) {
  const [name, count] = line.trim().split(/\s+/);
  const operation = operations[name];
  if (!operation) throw new Error(`unknown batch ${line}`);
  const samples = [];
  const cpu = process.cpuUsage();
  for (let i = 0; i < Number(count); i++) {
    const start = performance.now();
    await operation();
    samples.push(performance.now() - start);
  }
  const { user, system } = process.cpuUsage(cpu);
  process.stdout.write(JSON.stringify({ samples, cpu: (user + system) / 1000 }) + "\n");
}
