/**
 * The daemon's routes, typed by its OpenAPI document (`generated/wire.ts`).
 *
 * Every request the SDK makes names its route by the document's own path
 * template, and its body, query and answer take that route's types: a route,
 * field or answer the daemon changes makes `tsc` fail where the SDK uses it,
 * so the SDK cannot drift from the API it speaks.
 */
import type { components, paths } from "./generated/wire.js";

export type Schemas = components["schemas"];
export type Method = "get" | "put" | "post" | "delete";

/** The path templates that have an operation for `M`. */
export type Route<M extends Method> = {
  [P in keyof paths]: [NonNullable<paths[P][M]>] extends [never] ? never : P;
}[keyof paths];

type Operation<M extends Method, P extends Route<M>> = NonNullable<paths[P][M]>;

export type PathParams<M extends Method, P extends Route<M>> =
  Operation<M, P> extends { parameters: { path: infer A } } ? A : Record<string, never>;

export type Query<M extends Method, P extends Route<M>> =
  Operation<M, P> extends { parameters: { query?: infer Q } }
    ? [Q] extends [never | undefined] ? never : Q
    : never;

export type JsonBody<M extends Method, P extends Route<M>> =
  Operation<M, P> extends { requestBody?: { content: { "application/json": infer B } } }
    ? B
    : never;

type JsonOf<A> = A extends { content: { "application/json": infer J } } ? J : never;

/** The JSON a route answers with on success (`undefined` for a 204). */
export type Answer<M extends Method, P extends Route<M>> =
  Operation<M, P> extends { responses: infer R }
    ?
        | (200 extends keyof R ? JsonOf<R[200]> : never)
        | (201 extends keyof R ? JsonOf<R[201]> : never)
        | (204 extends keyof R ? undefined : never)
    : never;

/** One request's target: its method, its path with the parameters put in,
 * and (as types only) what it takes and answers. */
export interface Target<M extends Method, P extends Route<M>> {
  readonly method: Uppercase<M>;
  readonly path: string;
  /** Types only: never set. */
  readonly types?: { answer: Answer<M, P>; body: JsonBody<M, P>; query: Query<M, P> };
}

/** The request to `template` with `params` put in (each encoded as one path segment). */
export function route<M extends Method, P extends Route<M>>(
  method: M,
  template: P,
  params: PathParams<M, P>,
): Target<M, P> {
  const values = params as Record<string, string>;
  const path = (template as string).replace(/\{(\w+)\}/g, (_, name: string) => {
    const value = values[name];
    if (typeof value !== "string") {
      throw new TypeError(`${template}: ${name} must be a string`);
    }
    return encodeURIComponent(value);
  });
  return { method: method.toUpperCase() as Uppercase<M>, path };
}
