/* options.h -- one description of a program's options: the command line, JSON config files, --help.
 *
 * A program describes its options once, in a table of fu_opt entries ending with FU_OPT_END.
 * From that table fu_opt_parse() applies the defaults, then the JSON config files named on the
 * command line (--config), then the other flags in their order, so that flags override the
 * files; fu_opt_help() writes the --help text; fu_opt_main() does both for a main().
 *
 * Names: "--name VALUE" and "--name=VALUE", "-x VALUE" and "-xVALUE" where an entry has a short
 * name; '-' and '_' are the same in names, so a config file's key is the long name or an alias
 * written either way ("kv_budget_mib" for --kv-budget-mib). Keys starting with '_' and the key
 * "comment" document a file and are skipped. -h and --help are implicit.
 *
 * Threading: no state of its own; a table and its destinations are used by one thread at a time.
 * Ownership: the table owns what it stores. A FU_OPT_STRING, FU_OPT_PATH or FU_OPT_FILE_TEXT
 * destination is a `char *` that is NULL or malloc'd: a new value frees the old one; a
 * FU_OPT_LIST holds malloc'd copies; fu_opt_free() frees them all. Defaults given as text
 * (fu_opt.def) are stored the same way. Errors are status codes (status.h) with fu_last_error()
 * naming the option and the value; nothing here exits.
 */
#ifndef FU_OPTIONS_H
#define FU_OPTIONS_H

#include <stddef.h>
#include <stdio.h>

typedef enum fu_opt_kind {
    FU_OPT_FLAG,   /* bool or int: set by "--x" alone; "--x=false" or a config false clears it */
    FU_OPT_BOOL,   /* bool or int: a value true|false (also 1|0, yes|no, on|off) */
    FU_OPT_STRING, /* char *: a copy of the value */
    FU_OPT_PATH,   /* char *: a copy, a leading "~/" made "$HOME/" */
    FU_OPT_FILE_TEXT, /* char *: the text of the file named (4 KiB at most), trailing newlines
                         and spaces dropped: a secret kept out of argv */
    FU_OPT_LIST,   /* fu_opt_list: repeatable, each value appended; a config array gives several */
    FU_OPT_INT,    /* a 4- or 8-byte integer (int, long, size_t, uint64_t) in [lo, hi]; lo = hi = 0:
                      any the destination holds (unsigned destinations need lo >= 0) */
    FU_OPT_FLOAT,  /* float or double */
    FU_OPT_CHOICE, /* int or enum: the value of the choice named (fu_opt.choices) */
    FU_OPT_SPAN,   /* int[2]: "A:B", lo <= A < B <= hi (hi 0: INT_MAX), a span of blocks */
    FU_OPT_CALL,   /* fn(dest, value) does what the option means */
    FU_OPT_CONFIG, /* a JSON config file, loaded before the other flags (command line only) */
} fu_opt_kind;

enum {
    FU_OPT_NEGATE = 1 << 0, /* FU_OPT_FLAG / FU_OPT_BOOL: store the opposite ("--no-head") */
    FU_OPT_NOFILE = 1 << 1, /* command line only: not a config-file key */
    FU_OPT_REPEAT = 1 << 2, /* FU_OPT_CALL: a config-file array calls fn for each element */
};

/* One named value of a FU_OPT_CHOICE; a table of them ends with a NULL name. */
typedef struct fu_opt_choice {
    const char *name;
    int value;
} fu_opt_choice;

/* A FU_OPT_LIST destination: `n` malloc'd strings. Starts zeroed. */
typedef struct fu_opt_list {
    char **items;
    size_t n;
} fu_opt_list;

/* A FU_OPT_CALL handler: applies `value` to ctx (the entry's dest). Returns FU_OK, or an error
 * status with fu_errorf() saying what is wrong with the value (the caller adds the option's name). */
typedef int (*fu_opt_fn)(void *ctx, const char *value);

typedef struct fu_opt {
    const char *name;    /* long name, "max-tokens"; NULL ends a table */
    char short_name;     /* 'n' for -n; 0: none */
    fu_opt_kind kind;
    void *dest;          /* where the value goes (see the kinds); FU_OPT_CALL: fn's context */
    size_t size;         /* sizeof the destination (FU_OPT_TO sets dest and size) */
    const char *arg;     /* the value's name in the help ("N", "HOST:PORT"); NULL: the kind's */
    const char *help;    /* help text ('\n' starts an indented line); NULL: left out of the help */
    const char *def;     /* the default as text, stored by fu_opt_defaults(), shown in the help */
    long lo, hi;         /* FU_OPT_INT, FU_OPT_SPAN: the range */
    const fu_opt_choice *choices; /* FU_OPT_CHOICE */
    fu_opt_fn fn;        /* FU_OPT_CALL */
    const char *alias;   /* other names, '|'-separated ("hops|chain"): flags and config keys alike */
    unsigned flags;      /* FU_OPT_NEGATE, FU_OPT_NOFILE, FU_OPT_REPEAT */
} fu_opt;

/* The destination of an entry: FU_OPT_TO(args.max_tokens). */
#define FU_OPT_TO(field) .dest = &(field), .size = sizeof(field)
/* The end of a table. */
#define FU_OPT_END {0}

/* fu_opt_parse()'s answer when -h or --help was given. */
#define FU_OPT_HELP_ASKED 1
/* fu_opt_parse()'s answer when --print-config was given. */
#define FU_OPT_CONFIG_ASKED 2

/* A program's options and the text around them in its --help. */
typedef struct fu_opt_spec {
    const char *prog;   /* "fusion-shard": starts error lines */
    const char *usage;  /* the help's first line(s), "usage: fusion-shard --model ..." */
    const fu_opt *opts; /* the table */
    const char *epilog; /* text after the options; NULL: none */
} fu_opt_spec;

/* Stores every entry's default (fu_opt.def). FU_OK, or the status of a default that does
 * not parse (a bug in the table) or FU_ERR_NOMEM. */
int fu_opt_defaults(const fu_opt *opts);

/* Applies one value to the option called `name` (long name or alias, '-' or '_'); a flag
 * takes "true"/"false". FU_OK, FU_ERR_INVALID for an unknown option or a bad value
 * (fu_last_error(): "name: expected ..."), or the callback's status. */
int fu_opt_set(const fu_opt *opts, const char *name, const char *value);

/* Loads a JSON config file: an object whose keys are option names. Strings, integers,
 * numbers (FU_OPT_FLOAT) and booleans (flags) apply as on the command line; arrays apply each
 * element to a FU_OPT_LIST or FU_OPT_REPEAT option; null is skipped. Returns FU_OK;
 * FU_ERR_IO (the file cannot be opened); FU_ERR_FORMAT (not JSON, or not an object:
 * "path:line: ..."); FU_ERR_INVALID (an unknown key, a value of the wrong type or a bad value:
 * "path: key: ..."); or a callback's status. Keys before a bad one are applied. */
int fu_opt_load(const fu_opt *opts, const char *path);

/* Parses argv[1..argc): fu_opt_defaults(), then every --config file in order, then the other
 * options in order. Returns FU_OK; FU_OPT_HELP_ASKED if -h or --help is given, and
 * FU_OPT_CONFIG_ASKED for --print-config (nothing is applied then); FU_ERR_INVALID for an unknown option, a missing value, a value given to a
 * flag or a bad value; or the status of a config file or a callback. With n_operands NULL,
 * an argument that is no option is an error; else the operands (those and all after "--")
 * are moved, in order, to argv[1..*n_operands]. */
int fu_opt_parse(const fu_opt *opts, int argc, char **argv, int *n_operands);

/* Writes the help: spec->usage, one line per option with help text (its default added), -h,
 * then spec->epilog. */
void fu_opt_help(FILE *f, const fu_opt_spec *spec);

/* Writes a JSON config file naming every option a config file takes, in the table's order:
 * for each, a "_name" key with its help text (and value name), then "name" with its default
 * (a number, a boolean or a string as its kind takes; null -- which loading skips -- where it
 * has none; a command-line-only option gets the comment alone). Key names use '_' for '-'. It loads back (fu_opt_load) as the defaults, so an
 * example made by it cannot drift from the table. FU_OK or FU_ERR_NOMEM. */
int fu_opt_print_config(FILE *f, const fu_opt_spec *spec);

/* A main()'s option handling: fu_opt_parse(); on --help the help goes to stdout and 0 is
 * returned (on --print-config, fu_opt_print_config's file); on an error "PROG: message" and the help go to stderr and 2 is returned;
 * otherwise -1: the program goes on. */
int fu_opt_main(const fu_opt_spec *spec, int argc, char **argv, int *n_operands);

/* Writes "PROG: message" and the help to stderr; returns 2, a usage error's exit status. */
int fu_opt_fail(const fu_opt_spec *spec, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Frees what the table's string and list destinations hold and zeroes them. */
void fu_opt_free(const fu_opt *opts);

/* Splits "PREFIX:A:B" (PREFIX non-empty, itself perhaps holding colons, e.g. "[::1]:7001")
 * into *prefix (malloc'd; the caller frees it) and span[0] = A, span[1] = B with
 * 0 <= A < B <= hi. FU_OK, FU_ERR_INVALID or FU_ERR_NOMEM. */
int fu_opt_split_span(const char *s, long hi, char **prefix, int span[2]);

#endif
