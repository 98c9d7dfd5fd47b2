/**
 * The root of every error the SDK throws. `code` is the wire's stable error
 * code (`not_found`, `exec_timeout`, ...); each code has its class, generated
 * from the daemon's own table (`generated/errors.ts`), so `instanceof
 * FileNotFound`-style checks and `err.code` agree with the Python SDK.
 */
import type { components } from "./generated/wire.js";

export type ErrorDetail = components["schemas"]["ErrorDetail"];

export class HutchError extends Error {
  /** The wire code of errors of this class. */
  static readonly code: string = "hutch_error";
  /** The HTTP status the daemon answers with for this class. */
  static readonly httpStatus: number = 500;
  /** The wire code (as `HutchError.code` in Python). */
  readonly code: string;
  /** The error as the daemon sent it: code, message and its details. */
  readonly detail: Partial<ErrorDetail>;

  constructor(message: string, detail: Partial<ErrorDetail> = {}) {
    super(message);
    const cls = new.target as typeof HutchError;
    this.name = cls.name;
    // An unknown code keeps its own: a newer daemon's error is still told apart.
    this.code = cls === HutchError && detail.code ? detail.code : cls.code;
    this.detail = detail;
  }
}
